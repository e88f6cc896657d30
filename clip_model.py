"""
clip_model.py -- OpenAI's CLIP (ViT image tower + causal text tower), written out by hand.

Why by hand: DeAR (Ma et al., CVPR 2026) works per attention head: it measures what each
head of the last vision layers contributes (Sec. 3.2) and gives every head its own mask
(Sec. 3.3). `nn.MultiheadAttention` hides the heads, so here q, k, v are (B, H, N, D) and an
(H, N, N) mask is added to each head's scores. Everything else, down to the parameter names,
is OpenAI's `clip/model.py`, so checkpoints load with `load_state_dict(strict=True)`, and the
strict load is itself the architecture check. dear.py builds on this file, which imports only
torch, torchvision, ftfy and regex, so it can be copied out alone (docs/METHOD.md "CLIP").

Bottom-up: 1. blocks, 2. the two towers, 3. CLIP, 4. head_contributions (TextSpan),
5. build_model, 6. preprocessing, 7. the BPE tokenizer, 8. files: load, save, downloads,
the cache; 9. the command line. Float32, batch-first (mixed precision is the caller's autocast).

Shapes, the project's letters: B images (or texts) in a batch; N tokens of a sequence (an
image: 1 + G*G; a text: its context length); G the patch grid's side; W the width of a
tower's residual stream; H heads; D = W / H a head's width; E the joint embedding's width
(after proj / text_projection); L layers (of a tower, or the analysed last ones: each use says
which); R the image resolution; V the vocabulary size.

    python clip_model.py --weights ViT-B/16 --image cat.jpg --texts "a cat" "a dog"
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import os
import secrets
import sys
import urllib.error
import urllib.request
import warnings
from collections import OrderedDict
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import ftfy
import regex as re
import torch
import torch.nn as nn
import torch.nn.functional as F


class CLIPError(ValueError):
    """Bad input (an argument out of range or of the wrong shape). The message is one line
    that names it and says what to do; raised instead of `assert`, which `python -O` strips."""


# ---- 1. Building blocks -------------------------------------------------------------------

class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, computed and returned in fp32 whatever comes in: what CUDA's autocast
    does with it (and OpenAI's subclass, inside their fp16 model). The CPU's autocast would keep
    it in bf16; so with this, a half-precision run on the CPU has a GPU run's dtypes, op for op
    (not its kernels' summation order). In fp32 it is torch's LayerNorm exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float())


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x), the GELU approximation OpenAI trained CLIP with (the exact GELU
    would shift every activation and the published numbers with them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# open_clip's models without "-quickgelu" use the exact GELU; no checkpoint tells which.
ACTIVATIONS = {"quick_gelu": QuickGELU, "gelu": nn.GELU}


class AttentionDetails(NamedTuple):
    """weights: (B, H, N, N) softmax attention per head (row = query, column = key).
    head_outputs: (B, H, N, D) each head's output before out_proj mixes the heads; head h's
    share of the layer output is head_outputs[:, h] @ out_proj.weight[:, hD:(h+1)D].T."""

    weights: torch.Tensor
    head_outputs: torch.Tensor


# How the attention is computed (MultiHeadAttention.kernel; set_attention sets a whole model's):
#   "sdpa"      the default: F.scaled_dot_product_attention, one fused kernel of torch's choosing
#               (torch.nn.attention.sdpa_kernel may narrow the choice).
#   "explicit"  the maths written out below, every intermediate a tensor: slower and keeps the
#               (B, H, N, N) weights for backward, but it is the reference, and it avoids a fused
#               kernel that misbehaves on some GPU and torch build.
ATTENTION_KERNELS = ("sdpa", "explicit")


class MultiHeadAttention(nn.Module):
    """Self-attention with every head in plain sight. Not `nn.MultiheadAttention`, which splits
    the heads internally and takes one mask per sample: DeAR needs a mask per head (Sec. 3.3)
    and per-head outputs (Sec. 3.2). Its parameter names are kept: they are OpenAI's keys.
    attn_mask is additive (0 = may attend, -inf = may not), float, of shape (N, N) (all heads,
    e.g. the causal text mask), (H, N, N) (per head: DeAR's) or (B, H, N, N). A row all -inf
    would make the softmax NaN; the mask builders never produce one. `kernel`: one of
    ATTENTION_KERNELS; return_details always takes the explicit path (it returns the weights)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if heads < 1 or width % heads:
            raise CLIPError(f"width {width} does not split into heads={heads} equal heads; "
                            "pass a divisor of it")
        self.width, self.heads, self.head_dim = width, heads, width // heads
        self.kernel = "sdpa"
        # q, k, v projections stacked as OpenAI stores them: rows [0:W] q, [W:2W] k, [2W:3W] v.
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                return_details: bool = False):
        B, N, W = x.shape
        H, D = self.heads, self.head_dim
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, N, 3W)
        q, k, v = qkv.split(W, dim=-1)  # each (B, N, W)
        q, k, v = (t.view(B, N, H, D).transpose(1, 2) for t in (q, k, v))  # each (B, H, N, D)
        mask = self._checked_mask(attn_mask, B, N, q.dtype)  # None, or broadcasts to (B, H, N, N)
        if return_details or self.kernel == "explicit":  # the maths spelled out
            scores = (q @ k.transpose(-2, -1)) * D**-0.5  # (B, H, N, N)
            if mask is not None:
                scores = scores + mask  # each head its own mask
            # in fp32 under any autocast, as CUDA's autocast and the fused kernels compute it
            weights = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)  # (B, H, N, N)
            head_outputs = weights @ v  # (B, H, N, D)
        else:  # one fused kernel: the (B, H, N, N) matrix is never stored
            head_outputs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, D)
        side_by_side = head_outputs.transpose(1, 2).reshape(B, N, W)  # (B, N, W): H blocks of D
        out = self.out_proj(side_by_side)  # (B, N, W): out_proj mixes the heads
        if not return_details:
            return out
        return out, AttentionDetails(weights=weights, head_outputs=head_outputs)

    def _checked_mask(self, attn_mask: Optional[torch.Tensor], B: int, N: int, dtype: torch.dtype):
        """attn_mask -> None, or a mask that broadcasts to (B, H, N, N), in q's dtype (which the
        fused kernel wants under autocast). Checked on every call: it reads only the shape and
        dtype (no GPU work), and a wrong mask would otherwise be wrong without an error; a bool
        mask, for one (nn.MultiheadAttention's convention), would be added as 0/1."""
        if attn_mask is None:
            return None
        H = self.heads
        if not attn_mask.is_floating_point():
            raise CLIPError("attn_mask must be an additive float mask (0 / -inf), "
                            f"got dtype {attn_mask.dtype}")
        shapes = {2: (N, N), 3: (H, N, N), 4: (B, H, N, N)}
        if shapes.get(attn_mask.dim()) != tuple(attn_mask.shape):
            raise CLIPError(f"attn_mask has shape {tuple(attn_mask.shape)}; expected (N, N), "
                            f"(H, N, N) or (B, H, N, N) with B={B}, H={H}, N={N}")
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)  # (H, N, N) -> (1, H, N, N)
        return attn_mask.to(dtype)


class ResidualAttentionBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); the MLP is c_fc (W -> 4W),
    QuickGELU (or GELU), c_proj (4W -> W), with OpenAI's names."""

    def __init__(self, width: int, heads: int, activation: str = "quick_gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            choices = ", ".join(map(repr, ACTIVATIONS))
            raise CLIPError(f"activation={activation!r}; use one of {choices}")
        self.attn = MultiHeadAttention(width, heads)
        self.ln_1 = LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(width, width * 4)),
            ("gelu", ACTIVATIONS[activation]()),
            ("c_proj", nn.Linear(width * 4, width)),
        ]))
        self.ln_2 = LayerNorm(width)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)  # (B, N, W)
        return x + self.mlp(self.ln_2(x))  # (B, N, W)


class Transformer(nn.Module):
    """A stack of L residual blocks. A ModuleList, not OpenAI's nn.Sequential (same keys
    `resblocks.<i>.`), so that dear.py can run any slice of layers with its own mask."""

    def __init__(self, width: int, layers: int, heads: int, activation: str = "quick_gelu"):
        super().__init__()
        self.width, self.layers, self.heads = width, layers, heads
        blocks = [ResidualAttentionBlock(width, heads, activation) for _ in range(layers)]
        self.resblocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, attn_mask)
        return x


def set_attention(model: nn.Module, kernel: str) -> nn.Module:
    """Every attention layer of `model` computes with `kernel` (one of ATTENTION_KERNELS); the
    model is returned. The two give the same result up to rounding."""
    if kernel not in ATTENTION_KERNELS:
        raise CLIPError(f"attention kernel {kernel!r}: use one of {', '.join(ATTENTION_KERNELS)}")
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.kernel = kernel
    return model


# ---- 2. The two towers --------------------------------------------------------------------

class VisionTransformer(nn.Module):
    """Images (B, 3, R, R) -> embeddings (B, E). The G x G patches (G = R / patch_size) and a
    class token in front go through the transformer; the class token's final state, through
    ln_post and `proj` (W -> E), is the embedding."""

    def __init__(self, *, input_resolution: int, patch_size: int, width: int, layers: int,
                 heads: int, output_dim: int, activation: str = "quick_gelu"):
        super().__init__()
        if input_resolution % patch_size:
            raise CLIPError(f"image_resolution {input_resolution} is not a multiple of "
                            f"the patch size {patch_size}")
        self.input_resolution, self.patch_size = input_resolution, patch_size
        self.grid_size = input_resolution // patch_size  # G
        scale = width**-0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(self.grid_size**2 + 1, width))
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, layers, heads, activation)
        self.ln_post = LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, R, R) -> the tokens entering layer 0, (B, N, W) with N = 1 + G*G."""
        self._check_images(images)
        B = images.shape[0]
        x = self.conv1(images)  # (B, W, G, G)
        x = x.flatten(2).transpose(1, 2)  # (B, G*G, W): patches in row-major order
        cls = self.class_embedding.to(x.dtype).expand(B, 1, -1)  # (B, 1, W)
        x = torch.cat([cls, x], dim=1)  # (B, N, W): the class token first
        x = x + self.positional_embedding.to(x.dtype)  # (B, N, W)
        return self.ln_pre(x)

    def _check_images(self, images: torch.Tensor) -> None:
        """One line for images that are not (B, 3, R, R) at this model's R."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise CLIPError(f"images have shape {tuple(images.shape)}; expected (B, 3, R, R)")
        height, width = images.shape[2:]
        R = self.input_resolution
        if not height == width == R:
            raise CLIPError(f"images are {height}x{width}; this model expects {R}x{R} "
                            "(use the model's preprocess)")

    def to_embedding(self, cls_token: torch.Tensor) -> torch.Tensor:
        """Final class-token state (B, W) -> embedding (B, E); a name of its own for dear.py."""
        return self.ln_post(cls_token) @ self.proj

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)  # (B, N, W)
        x = self.transformer(x)  # (B, N, W)
        return self.to_embedding(x[:, 0])  # (B, E)


def causal_mask(num_tokens: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(N, N) additive mask: token i sees tokens 0..i only. So token i never depends on later
    tokens, and a text may be cut right after its last real token without changing it."""
    mask = torch.full((num_tokens, num_tokens), float("-inf"), device=device, dtype=dtype)
    return mask.triu_(1)


# ---- 3. CLIP ------------------------------------------------------------------------------

class CLIP(nn.Module):
    """The two towers and the temperature. The text tower's parts (`token_embedding`,
    `positional_embedding`, `transformer`, `ln_final`, `text_projection`) sit at the top level,
    where OpenAI's state dict has them. activation: "quick_gelu" (OpenAI) or "gelu"."""

    def __init__(self, *, embed_dim: int, image_resolution: int, vision_layers: int,
                 vision_width: int, vision_patch_size: int, vision_heads: int,
                 context_length: int, vocab_size: int, transformer_width: int,
                 transformer_heads: int, transformer_layers: int, activation: str = "quick_gelu"):
        super().__init__()
        self.context_length, self.activation = context_length, activation
        self.visual = VisionTransformer(
            input_resolution=image_resolution, patch_size=vision_patch_size, width=vision_width,
            layers=vision_layers, heads=vision_heads, output_dim=embed_dim, activation=activation)
        self.transformer = Transformer(transformer_width, transformer_layers, transformer_heads,
                                       activation)
        self.token_embedding = nn.Embedding(vocab_size, transformer_width)  # (V, W)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, transformer_width))
        self.ln_final = LayerNorm(transformer_width)
        self.text_projection = nn.Parameter(torch.empty(transformer_width, embed_dim))  # (W, E)
        # The temperature is learned as a log so that it stays positive: s = exp(logit_scale).
        self.logit_scale = nn.Parameter(torch.ones([]) * torch.log(torch.tensor(1 / 0.07)))
        self.initialize_parameters()

    def initialize_parameters(self) -> None:
        """OpenAI's initialisation (for training a CLIP from scratch, as the toy world does)."""
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        for tower in (self.transformer, self.visual.transformer):
            width = tower.width
            # smaller for the projections back into the stream: their outputs add up over layers
            proj_std = width**-0.5 * (2 * tower.layers) ** -0.5
            for block in tower.resblocks:
                nn.init.normal_(block.attn.in_proj_weight, std=width**-0.5)
                nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
                nn.init.normal_(block.mlp.c_fc.weight, std=(2 * width) ** -0.5)
                nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=self.transformer.width**-0.5)

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.conv1.weight.dtype

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, R, R) -> (B, E), not normalised (as OpenAI's)."""
        return self.visual(images.to(self.dtype))

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """Token ids (B, N) -> the tokens entering text layer 0, (B, N, W); N may be shorter
        than the context (see `causal_mask`)."""
        N = text.shape[1]
        if N > self.context_length:
            raise CLIPError(f"text has {N} tokens; this model's context length is "
                            f"{self.context_length} (tokenize with "
                            "context_length=model.context_length)")
        return self.token_embedding(text) + self.positional_embedding[:N]  # (B, N, W)

    def text_to_embedding(self, x: torch.Tensor, eot_positions: torch.Tensor) -> torch.Tensor:
        """Final text states (B, N, W) -> text embedding (B, E), read at each end-of-text token."""
        x = self.ln_final(x)  # (B, N, W)
        eot = x[torch.arange(x.shape[0], device=x.device), eot_positions]  # (B, W)
        return eot @ self.text_projection  # (B, E)

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        """Token ids (B, N) -> (B, E), not normalised, read at the end-of-text token: its id is
        the vocabulary's largest (the specials come last), so argmax finds it (OpenAI's trick)."""
        x = self.embed_text(text)  # (B, N, W)
        x = self.transformer(x, causal_mask(x.shape[1], x.device, x.dtype))  # (B, N, W)
        return self.text_to_embedding(x, text.argmax(dim=-1))  # (B, E)

    def forward(self, images: torch.Tensor, text: torch.Tensor):
        """OpenAI's logits, cosines times exp(logit_scale): per image (images, texts) and per
        text (texts, images)."""
        image_features = F.normalize(self.encode_image(images), dim=-1)
        text_features = F.normalize(self.encode_text(text), dim=-1)
        logits_per_image = self.logit_scale.exp() * image_features @ text_features.t()
        return logits_per_image, logits_per_image.t()


# ---- 4. The image embedding as a sum of per-head terms (TextSpan) -------------------------
# Gandelsman et al., "Interpreting CLIP's Image Representation via Text-Based Decomposition"
# (TextSpan), ICLR 2024, Sec. 3. For the class token of one image, write
#     r          its final state (W,), the input of ln_post
#     o_lh       head h's output in layer l (D,), before out_proj
#     O_h        out_proj.weight[:, hD:(h+1)D] (W, D), the columns that o_lh meets
#     gamma, b   ln_post's weight and bias (LayerNorm's own; not DeAR's beta)
#     s          sqrt(var(r) + eps), LayerNorm's denominator for r
#  1. The residual stream only adds, so r is the sum of all that was written into it
#     (z: the class token after ln_pre):
#         r = z + sum_l (attn_l + mlp_l)
#  2. out_proj is linear, so each attention output is a sum over the heads:
#         attn_l = sum_h O_h o_lh + out_proj.bias
#  3. With s held at the full r's value, LayerNorm is linear (centring is: mean(r) is the sum
#     of the terms' means), so each term t of steps 1 and 2 goes through on its own:
#         ln_post(r) = gamma * (r - mean(r)) / s + b = sum_t gamma * (t - mean(t)) / s + b
#  4. proj is linear too, so the embedding is a sum of one term per head, per MLP, the rest:
#         ln_post(r) @ proj = sum_t [gamma * (t - mean(t)) / s] @ proj + b @ proj
# head_contributions splits out the last L layers; z and the earlier layers stay one term.

class HeadContributions(NamedTuple):
    """Direct contributions to each image embedding (all in embedding space, E):
    heads (B, L, H, E) every head of the last L layers (with a share out_proj.bias / H of the
    bias), mlps (B, L, E) the MLPs of those layers, rest (B, E) the embeddings and all earlier
    layers, bias (E,) ln_post's bias through proj; layers: the L 0-based indices (the paper
    counts from 1). Invariant: total() == model.encode_image(images)."""

    heads: torch.Tensor
    mlps: torch.Tensor
    rest: torch.Tensor
    bias: torch.Tensor
    layers: tuple

    def total(self) -> torch.Tensor:  # the sum of all terms: the image embedding (B, E)
        return self.heads.sum((1, 2)) + self.mlps.sum(1) + self.rest + self.bias


@torch.no_grad()
def head_contributions(model: CLIP, images: torch.Tensor, num_layers: int = 4) -> HeadContributions:
    """Decompose `model.encode_image(images)` ((B, 3, R, R) preprocessed) into per-head direct
    contributions (the derivation above), over the last L = num_layers vision layers; `heads`,
    (B, L, H, E), is what DeAR's head analysis reads. No gradient: the terms are for analysis."""
    visual = model.visual
    blocks = visual.transformer.resblocks
    if not 1 <= num_layers <= len(blocks):
        raise CLIPError(f"num_layers={num_layers} is out of range: "
                        f"this model has {len(blocks)} vision layers")
    first = len(blocks) - num_layers
    x = visual.embed(images.to(model.dtype))  # (B, N, W)
    for block in blocks[:first]:
        x = block(x)
    rest = x[:, 0]  # (B, W): z and all earlier layers, at the class token

    head_terms, mlp_terms = [], []
    for block in blocks[first:]:  # step 1, one layer at a time
        attn = block.attn
        W, H, D = attn.width, attn.heads, attn.head_dim
        attn_out, details = attn(block.ln_1(x), return_details=True)  # (B, N, W)
        o = details.head_outputs[:, :, 0]  # (B, H, D): each head's output at the class token
        w_out = attn.out_proj.weight.view(W, H, D)  # (W, H, D): w_out[:, h] is O_h
        per_head = torch.einsum("bhd,whd->bhw", o, w_out)  # (B, H, W): step 2's O_h o_lh
        head_terms.append(per_head + attn.out_proj.bias / H)  # each head a share of the bias
        x = x + attn_out
        mlp_out = block.mlp(block.ln_2(x))  # (B, N, W)
        mlp_terms.append(mlp_out[:, 0])  # (B, W)
        x = x + mlp_out

    ln = visual.ln_post
    r = x[:, 0]  # (B, W)
    std = (r.var(dim=-1, unbiased=False, keepdim=True) + ln.eps).sqrt()  # (B, 1): step 3's s

    def through_ln_post_and_proj(term: torch.Tensor) -> torch.Tensor:
        """(B, ..., W) -> (B, ..., E): the term's share of ln_post(r) @ proj (steps 3 and 4)."""
        scale = std.view(std.shape[0], *([1] * (term.dim() - 1)))  # broadcast over middle dims
        centred = term - term.mean(dim=-1, keepdim=True)
        return (centred / scale * ln.weight) @ visual.proj

    return HeadContributions(
        heads=through_ln_post_and_proj(torch.stack(head_terms, dim=1)),  # (B, L, H, E)
        mlps=through_ln_post_and_proj(torch.stack(mlp_terms, dim=1)),  # (B, L, E)
        rest=through_ln_post_and_proj(rest),  # (B, E)
        bias=ln.bias @ visual.proj,  # (E,)
        layers=tuple(range(first, len(blocks))),
    )


# ---- 5. build_model: the architecture read off the tensors --------------------------------

class CLIPFileError(CLIPError, RuntimeError):
    """A checkpoint or BPE file that cannot be found, fetched or read; one line naming it."""


def _one_line(text: object, limit: int = 200) -> str:
    """An exception's text squashed into one short line, for the messages of CLIPFileError."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# Not parameters: OpenAI's TorchScript files carry the first three, `save` writes the last three.
_METADATA_KEYS = ("input_resolution", "context_length", "vocab_size",
                  "vision_heads", "text_heads", "activation")


def build_model(state_dict: dict, head_width: Optional[int] = None,
                vision_heads: Optional[int] = None, text_heads: Optional[int] = None,
                activation: Optional[str] = None) -> CLIP:
    """A CLIP shaped like `state_dict`, its weights loaded strictly, in eval mode, float32.
    Every size is read off a tensor, as OpenAI's build_model does (ViT-B/32, B/16, L/14 and any
    model saved with the same keys). What no tensor tells, and what changes every output when
    wrong: the heads per tower (the file's, else the arguments, else 64 wide: `_heads`) and the
    MLP activation (the file's, else the argument, else "quick_gelu"; see ACTIVATIONS)."""
    state_dict = dict(state_dict)
    stored = {k: state_dict.pop(k) for k in _METADATA_KEYS if k in state_dict}
    if any(k.startswith(("visual.layer1.", "visual.attnpool.")) for k in state_dict):
        raise CLIPFileError("this is a ResNet CLIP checkpoint (visual.layer1 / visual.attnpool "
                            "keys); only the ViT models are supported: use ViT-B/32, ViT-B/16 "
                            "or ViT-L/14")
    try:
        vision_width = state_dict["visual.conv1.weight"].shape[0]
        vision_patch_size = state_dict["visual.conv1.weight"].shape[-1]
        grid_size = round((state_dict["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        embed_dim = state_dict["text_projection"].shape[1]
        context_length, transformer_width = state_dict["positional_embedding"].shape
        vocab_size = state_dict["token_embedding.weight"].shape[0]
    except KeyError as error:
        raise CLIPFileError(f"not an OpenAI CLIP ViT state dict: it has no {error}") from None
    vision_layers = len([k for k in state_dict
                         if k.startswith("visual.") and k.endswith(".attn.in_proj_weight")])
    transformer_layers = len({k.split(".")[2] for k in state_dict
                              if k.startswith("transformer.resblocks.")})
    if activation is not None and stored.get("activation", activation) != activation:
        raise CLIPFileError(f"the file says activation={stored['activation']!r}, the arguments "
                            f"ask for {activation!r}; leave activation out to use the file's")
    vision_heads = _heads("vision", vision_width, stored.get("vision_heads"), vision_heads,
                          head_width)
    text_heads = _heads("text", transformer_width, stored.get("text_heads"), text_heads,
                        head_width)
    model = CLIP(embed_dim=embed_dim, image_resolution=vision_patch_size * grid_size,
                 vision_layers=vision_layers, vision_width=vision_width,
                 vision_patch_size=vision_patch_size, vision_heads=vision_heads,
                 context_length=context_length, vocab_size=vocab_size,
                 transformer_width=transformer_width, transformer_heads=text_heads,
                 transformer_layers=transformer_layers,
                 activation=activation or stored.get("activation", "quick_gelu"))
    try:  # the strict load checks every key and shape; torch's message, on one line
        model.load_state_dict({k: v.float() for k, v in state_dict.items()})
    except RuntimeError as error:
        # drop torch's "Error(s) in loading state_dict for CLIP:"
        problem = _one_line(str(error).partition(":")[2], 300)
        raise CLIPFileError(f"state dict does not fit a CLIP ViT: {problem}") from None
    return model.eval()


OPENAI_HEAD_WIDTH = 64  # channels per head in every OpenAI CLIP: a file that does not say has them


def _heads(what: str, width: int, stored, heads, head_width) -> int:
    """One tower's head count: the argument (`heads`, else width / `head_width`), else the
    file's entry, else OpenAI's heads of 64 channels. An argument that contradicts the file is
    refused: it would build another model than the one trained."""
    if heads is None and head_width is not None:
        if head_width < 1 or width % head_width:
            raise CLIPFileError(f"the {what} width {width} is not a multiple of "
                                f"head_width={head_width}; pass the head_width the model was "
                                "trained with")
        heads = width // head_width
    if heads is not None and stored is not None and heads != int(stored):
        raise CLIPFileError(f"the file says {what}_heads={int(stored)}, the arguments ask for "
                            f"{heads}; leave vision_heads/text_heads/head_width out to use "
                            "the file's")
    if heads is None and stored is None and width % OPENAI_HEAD_WIDTH:
        raise CLIPFileError(f"the {what} width {width} is not a multiple of {OPENAI_HEAD_WIDTH} "
                            "(OpenAI's head width); pass the head_width "
                            "(or vision_heads/text_heads) the model was trained with")
    if heads is None:
        heads = int(stored) if stored is not None else width // OPENAI_HEAD_WIDTH
    return heads


# ---- 6. Image preprocessing (OpenAI's test transform) -------------------------------------

# The RGB statistics of CLIP's training set. data.py, which stands alone, keeps a copy of them
# and of this transform: change both together.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _to_rgb(image):  # a function, not a lambda, so that DataLoader workers can pickle it
    return image.convert("RGB")  # greyscale, palette and RGBA images exist in the benchmarks


def image_transform(resolution: int = 224):
    """OpenAI's `preprocess`: short side to R = `resolution`, centre crop; image -> (3, R, R)."""
    from torchvision import transforms as T  # torchvision is needed only here
    return T.Compose([T.Resize(resolution, interpolation=T.InterpolationMode.BICUBIC),
                      T.CenterCrop(resolution), _to_rgb, T.ToTensor(),
                      T.Normalize(CLIP_MEAN, CLIP_STD)])


# ---- 7. Tokenizer: CLIP's byte-level BPE --------------------------------------------------
# Text -> clean (ftfy, HTML entities, whitespace, lower case) -> words and punctuation runs
# (a regex) -> each word's UTF-8 bytes as printable characters -> the merges, in the order
# the merges file lists them -> ids.

_MAX_MERGES = 49152 - 256 - 2  # CLIP's V = 49408 = 2*256 bytes + 48894 merges + 2 specials

# OpenAI's pre-tokenisation: the special tokens, contractions ("don't" -> "don", "'t"), words,
# single digits, runs of other non-space characters. A constant so that the toy world's BPE
# learner (toyworld/bpe.py) splits text exactly as the tokenizer does.
PRETOKENIZE = re.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    re.IGNORECASE,
)


def bytes_to_unicode() -> dict:
    """Each byte value -> a printable character, so that BPE works on bytes (any text has a
    spelling) with no whitespace or control characters in tokens. Printable bytes map to
    themselves, the other 68 to chr(256 + i): b" " -> "Ġ", "é" (bytes 195, 169) -> "Ã©"."""
    printable = (list(range(ord("!"), ord("~") + 1))
                 + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    characters, moved = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + moved)
            moved += 1
    return dict(zip(printable, map(chr, characters)))


def basic_clean(text: str) -> str:
    """Fix mojibake (ftfy) and HTML entities (twice: some web text is double-escaped)."""
    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


def whitespace_clean(text: str) -> str:
    return " ".join(text.split())


def merge_pair(symbols: Sequence[str], pair: Tuple[str, str]) -> List[str]:
    """One BPE merge, left to right: ["c", "i", "r", "c"] with ("c", "i") -> ["ci", "r", "c"]."""
    merged, i = [], 0
    while i < len(symbols):
        if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


class SimpleTokenizer:
    """CLIP's tokenizer: `encode(text) -> ids`, `decode(ids) -> text`, `tokenize(texts)`.
    bpe_path: a merges file in OpenAI's format (a header line, then "left right" per line in
    priority order; gzip or plain), found by find_bpe_file when not given. The first 48,894
    merges are read, as OpenAI does; a smaller file (one learned on your own captions) gives
    V = 512 + merges + 2 ids."""

    def __init__(self, bpe_path: Optional[str] = None):
        self.bpe_path = find_bpe_file(bpe_path)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        merges = self._read_merges()
        # The two specials last, so that end-of-text has the largest id (see CLIP.encode_text).
        vocab = list(self.byte_encoder.values())  # the 256 bytes
        vocab += [v + "</w>" for v in vocab]  # the same, as word endings
        vocab += ["".join(pair) for pair in merges]  # one entry per merge
        vocab += ["<|startoftext|>", "<|endoftext|>"]
        self.encoder = {token: index for index, token in enumerate(vocab)}
        self.decoder = {index: token for token, index in self.encoder.items()}
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}  # lower = merged first
        self.sot_token = self.encoder["<|startoftext|>"]
        self.eot_token = self.encoder["<|endoftext|>"]
        self.cache = {"<|startoftext|>": "<|startoftext|>", "<|endoftext|>": "<|endoftext|>"}

    def _read_merges(self) -> List[Tuple[str, str]]:
        """The merges file's first _MAX_MERGES pairs, in priority order; one line if unreadable."""
        try:
            opener = gzip.open if self.bpe_path.endswith(".gz") else open
            with opener(self.bpe_path, "rt", encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, UnicodeDecodeError, EOFError) as error:
            raise CLIPFileError(f"{self.bpe_path}: cannot read the BPE merges file "
                                f"({_one_line(error, 80)})") from None
        merges = []
        for number, line in enumerate(lines[1:], start=2):  # line 1 is the "#version" header
            if len(merges) == _MAX_MERGES:
                break
            if not line.strip():
                continue
            if len(line.split()) != 2:
                raise CLIPFileError(f"{self.bpe_path}: line {number} is not a 'left right' "
                                    f"merge: {line[:40]!r}")
            merges.append(tuple(line.split()))
        return merges

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def check_fits(self, model: CLIP, weights: str) -> None:
        """One line unless this is the model's vocabulary (else: ids past its table, or others)."""
        model_size = model.token_embedding.num_embeddings
        if self.vocab_size != model_size:
            raise CLIPFileError(f"{self.bpe_path}: gives a vocabulary of {self.vocab_size} "
                                f"tokens, the model {weights} has {model_size}; pass the BPE "
                                "file it was trained with")

    def bpe(self, token: str) -> str:
        """One word -> its pieces, space-separated: start from characters (the last marked as a
        word end, "</w>"), merge the best-ranked adjacent pair everywhere, until none is ranked."""
        if token not in self.cache:
            word = list(token[:-1]) + [token[-1] + "</w>"]
            while len(word) > 1:
                pairs = set(zip(word, word[1:]))
                best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
                if best not in self.bpe_ranks:
                    break
                word = merge_pair(word, best)
            self.cache[token] = " ".join(word)
        return self.cache[token]

    def encode(self, text: str) -> list:
        ids = []
        for word in re.findall(PRETOKENIZE, whitespace_clean(basic_clean(text)).lower()):
            spelled = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(spelled).split(" "))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        utf8 = bytearray(self.byte_decoder[c] for c in text)
        return utf8.decode("utf-8", errors="replace").replace("</w>", " ")

    def tokenize(self, texts: Union[str, Sequence[str]], context_length=77,
                 truncate=False) -> torch.Tensor:
        """Texts -> (len(texts), context_length) ids: start token, the text, end token, zeros.
        Too long a text is an error, unless truncate=True keeps the first context_length - 1
        ids and ends with the end-of-text token (OpenAI's rule)."""
        texts = [texts] if isinstance(texts, str) else texts
        result = torch.zeros(len(texts), context_length, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.sot_token] + self.encode(text) + [self.eot_token]
            if len(ids) > context_length:
                if not truncate:
                    raise CLIPError(f"text {text[:40]!r}... is {len(ids)} tokens, longer than the "
                                    f"context length {context_length}; shorten it or pass "
                                    "truncate=True")
                ids = ids[: context_length - 1] + [self.eot_token]
            result[row, : len(ids)] = torch.tensor(ids)
        return result


_tokenizers: dict = {}  # bpe_path (None = found by find_bpe_file) -> SimpleTokenizer, built once


def tokenize(texts: Union[str, Sequence[str]], context_length: int = 77, truncate: bool = False,
             tokenizer: Optional[SimpleTokenizer] = None,
             bpe_path: Optional[str] = None) -> torch.Tensor:
    """OpenAI's `clip.tokenize`, with `tokenizer`, else one built for `bpe_path` on first use
    (without bpe_path the merges file is found or downloaded: see find_bpe_file)."""
    if tokenizer is None:
        if bpe_path not in _tokenizers:
            _tokenizers[bpe_path] = SimpleTokenizer(bpe_path)
        tokenizer = _tokenizers[bpe_path]
    return tokenizer.tokenize(texts, context_length, truncate)


# ---- 8. Files: load, save, downloads (SHA-256 checked) and the cache ----------------------
# The plumbing OpenAI keeps in clip/clip.py (the cache: default_cache_dir; BPE: find_bpe_file).

# OpenAI's published ViT checkpoints; the hex folder in each address is the file's SHA-256.
_OPENAI_URL = "https://openaipublic.azureedge.net/clip/models/"
_MODELS = {
    "ViT-B/32": _OPENAI_URL + "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt",
    "ViT-B/16": _OPENAI_URL + "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f/ViT-B-16.pt",
    "ViT-L/14": _OPENAI_URL + "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836/ViT-L-14.pt",
}

BPE_FILENAME = "bpe_simple_vocab_16e6.txt.gz"
BPE_URL = "https://github.com/openai/CLIP/raw/main/clip/bpe_simple_vocab_16e6.txt.gz"
BPE_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"


def load(name_or_path: str, device: Union[str, torch.device] = "cpu", jit: bool = False,
         download_root: Optional[str] = None, head_width: Optional[int] = None,
         vision_heads: Optional[int] = None, text_heads: Optional[int] = None,
         activation: Optional[str] = None):
    """A CLIP ViT -> (model in eval mode, float32, on `device`; its test transform).

    name_or_path: a name in `_MODELS` (cached, else downloaded and SHA-256 checked) or a file
    (OpenAI's TorchScript, or a state dict with OpenAI's keys). jit=False is OpenAI's argument.
    Foreign state dicts (not OpenAI's, not written by `save`) need what no tensor tells, or
    they load *wrong without an error*: heads not 64 wide (`head_width=32`, or `vision_heads=`
    / `text_heads=`), `activation="gelu"` for open_clip's models without "-quickgelu".
    """
    if jit:
        raise CLIPError("jit=True is not supported: this module builds the eager model, which is "
                        "what the per-head analysis needs; pass jit=False")
    if name_or_path in _MODELS:
        url = _MODELS[name_or_path]
        sha256 = url.split("/")[-2]
        path = download(url, sha256, download_root, what=f"CLIP {name_or_path}")
    elif os.path.isfile(name_or_path):
        path = name_or_path
    else:
        raise CLIPFileError(f"{name_or_path}: neither a model name ({', '.join(_MODELS)}) nor an "
                            "existing file; pass one of those names or the path to a checkpoint")
    state_dict = read_state_dict(path)
    try:
        model = build_model(state_dict, head_width=head_width, vision_heads=vision_heads,
                            text_heads=text_heads, activation=activation)
    except CLIPError as error:  # also the model's own checks (head split, activation name)
        raise CLIPFileError(f"{path}: {error}") from None
    return model.to(device), image_transform(model.visual.input_resolution)


def read_state_dict(path: str) -> dict:
    """A checkpoint file -> {name: tensor} on the CPU. As OpenAI's clip.load: a TorchScript
    archive (OpenAI's files) gives its state_dict() and runs none of its code; anything else
    is read as a plain state dict, with weights_only=True so that loading runs no code."""
    if not os.path.isfile(path):
        raise CLIPFileError(f"{path}: no such file; pass the path to a CLIP checkpoint")
    try:
        try:
            with warnings.catch_warnings():  # recent torch marks TorchScript deprecated
                warnings.simplefilter("ignore", FutureWarning)
                state_dict = torch.jit.load(path, map_location="cpu").state_dict()
        except RuntimeError:  # not a TorchScript archive
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds here; all mean "unreadable"
        raise CLIPFileError(f"{path}: cannot be read as a checkpoint (truncated, corrupt or not "
                            f"a PyTorch file: {_one_line(error, 100)}); download it again or "
                            "pass another file") from None
    if not _is_state_dict(state_dict):
        raise CLIPFileError(f"{path}: holds a {type(state_dict).__name__}, "
                            "not a state dict of tensors")
    return dict(state_dict)


def _is_state_dict(thing) -> bool:
    """A dict of name -> tensor, the metadata entries (`_METADATA_KEYS`) aside."""
    return isinstance(thing, dict) and all(
        isinstance(k, str) and (torch.is_tensor(v) or k in _METADATA_KEYS)
        for k, v in thing.items())


def save(model: CLIP, path: str) -> None:
    """OpenAI's keys plus "vision_heads", "text_heads", "activation", so that `load(path)` needs
    no argument. Atomic; the same tensors give the same bytes (through a file handle torch
    names the zip's inner folder "archive"), so the file's SHA-256 identifies the model."""
    state = dict(model.state_dict(), vision_heads=model.visual.transformer.heads,
                 text_heads=model.transformer.heads, activation=model.activation)

    def write(temporary: str) -> None:
        with open(temporary, "wb") as handle:
            torch.save(state, handle)

    atomic_write(path, write)


def default_cache_dir() -> str:
    """$CLIP_CACHE_DIR, else ~/.cache/clip-from-scratch. The older names still work:
    $DEAR_CACHE_DIR, and ~/.cache/dear-from-scratch if it exists and the new one does not."""
    home_cache = os.path.join(os.path.expanduser("~"), ".cache")
    new = os.path.join(home_cache, "clip-from-scratch")
    old = os.path.join(home_cache, "dear-from-scratch")
    fallback = old if os.path.isdir(old) and not os.path.isdir(new) else new
    return os.environ.get("CLIP_CACHE_DIR") or os.environ.get("DEAR_CACHE_DIR") or fallback


def download(url: str, sha256: str, root: Optional[str] = None, what: str = "file") -> str:
    """Fetch `url` into `root` (default: the cache) unless a file with the right SHA-256 is
    there already; return its path. The name appears only for a complete, checked file
    (atomic_write). Progress lines go to stderr."""
    target = os.path.join(root or default_cache_dir(), os.path.basename(url))
    if os.path.isfile(target):
        if _sha256(target) == sha256:
            return target
        print(f"{target}: checksum does not match; downloading it again", file=sys.stderr)

    def fetch(partial: str) -> None:
        try:
            with urllib.request.urlopen(url, timeout=30) as source, open(partial, "wb") as sink:
                total, done = int(source.headers.get("Content-Length") or 0), 0
                chunks = iter(lambda: source.read(1 << 20), b"")
                for number, chunk in enumerate(chunks, start=1):
                    sink.write(chunk)
                    done += len(chunk)
                    if number % 32 == 0 or done == total:  # a line every 32 MiB, and at the end
                        share = f" ({100 * done / total:.0f}%)" if total else ""
                        print(f"downloading {what}: {done / 2**20:.1f} MiB{share}", file=sys.stderr)
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = _one_line(getattr(error, "reason", error), 120)
            raise CLIPFileError(f"{what}: cannot download {url} ({reason}); without network, "
                                "get the file elsewhere and pass its local path") from None
        if _sha256(partial) != sha256:
            raise CLIPFileError(f"{what}: the file downloaded from {url} fails its SHA-256 "
                                "check; try again")

    atomic_write(target, fetch)
    return target


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call write(temporary_path), then rename it onto `path`: readers never see half a file,
    and a failed write leaves no temporary behind. The project's one copy (dear.py and the
    toy world reuse it; data.py, which stands alone, keeps its own small one)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    # A fresh name (48 random bits); `write` creates it, mode 0666 less the umask (mkstemp: 0600).
    temporary = os.path.join(folder, f".tmp-{secrets.token_hex(6)}-{os.path.basename(path)}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def find_bpe_file(bpe_path: Optional[str] = None) -> str:
    """CLIP's merges file: the argument, else $CLIP_BPE_PATH (or the older $DEAR_BPE_PATH), else
    the cache, else a download (SHA-256 checked); else a one-line error saying what to pass."""
    given = (("bpe_path", bpe_path),
             ("$CLIP_BPE_PATH", os.environ.get("CLIP_BPE_PATH")),
             ("$DEAR_BPE_PATH", os.environ.get("DEAR_BPE_PATH")))
    for source, path in given:
        if path:
            if not os.path.isfile(path):
                raise CLIPFileError(f"{path} (from {source}): no such BPE merges file")
            return path
    cached = os.path.join(default_cache_dir(), BPE_FILENAME)
    if os.path.isfile(cached):
        return cached
    try:
        return download(BPE_URL, BPE_SHA256, what="CLIP's BPE merges file")
    except CLIPFileError as error:
        raise CLIPFileError(f"{error} -- or pass bpe_path= / set CLIP_BPE_PATH to a "
                            f"{BPE_FILENAME} (open_clip and openai/CLIP ship one), or copy it "
                            f"to {cached}") from None


# ---- 9. Command line: zero-shot scores of one image against a few texts -------------------

def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Score an image against texts with CLIP.")
    parser.add_argument("--weights", default="ViT-B/16", help="model name or checkpoint path")
    parser.add_argument("--bpe", help="CLIP's BPE merges file "
                        "(default: $CLIP_BPE_PATH, the cache, a download)")
    parser.add_argument("--image", required=True, help="an image file")
    parser.add_argument("--texts", nargs="+", required=True, help="candidate captions")
    parser.add_argument("--head-width", type=int, help="channels per head, for a foreign checkpoint "
                        "whose heads are not 64 wide (files written by save carry theirs)")
    parser.add_argument("--activation", choices=sorted(ACTIVATIONS), help="MLP activation of a "
                        "foreign checkpoint: gelu for open_clip's without -quickgelu (default: "
                        "the file's, else quick_gelu)")
    args = parser.parse_args(argv)
    try:
        from PIL import Image, UnidentifiedImageError
        try:  # load(): a header that opens may still hide pixels that do not
            with Image.open(args.image) as picture:
                picture.load()
        except (UnidentifiedImageError, OSError) as error:  # also absent files and folders
            raise CLIPFileError(f"{args.image}: cannot be read as an image "
                                f"({_one_line(error, 80)})") from None
        model, preprocess = load(args.weights, head_width=args.head_width,
                                 activation=args.activation)
        tokenizer = SimpleTokenizer(args.bpe)
        tokenizer.check_fits(model, args.weights)
        image = preprocess(picture).unsqueeze(0)
        text = tokenize(args.texts, model.context_length, truncate=True, tokenizer=tokenizer)
    except CLIPError as error:
        print(f"clip_model.py: error: {error}", file=sys.stderr)
        return 2
    with torch.no_grad():
        logits, _ = model(image, text)
    for caption, p in zip(args.texts, logits.softmax(-1)[0].tolist()):
        print(f"{p:6.1%}  {caption}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
