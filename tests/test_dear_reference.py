"""DeAR's forward pass against an independent reference written from the spec: `reference` below is
also the method in one page (dear.py's docstring points here), one head at a time. Its letters
are the project's (dear.py's legend): B images, C classes, N tokens (N_t a text's), W a tower's
width (W_v, W_t), H heads, D a head's width, E the embedding, A attribute tokens, K text tokens.

    python -m pytest -q tests/test_dear_reference.py

The reference below reads CLIP's frozen weights and DeAR's learnable tensors as plain data and
computes everything itself, one head at a time: patch embedding, pre-LN blocks, the per-head
role masks (built here from the role table, not by dear.py), the beta rule for the attribute
tokens and the text tokens, ln_post and the projections, the branch logits and the softmax
fusion. It calls nothing of dear.py and no forward of clip_model.py. DeAR must match it to
1e-5 at J = 1, 2 and 3 with beta = 0.3 (beta = 0.5 hides a swapped rule), K = 3 text tokens,
every learnable tensor randomised (fusion weights and attribute projection included), CLIP's
own weights perturbed, and a role map whose roles differ from layer to layer (every role, and
a layer the map does not cover, which must act as mixed).

The reference is also the plain computation that DeAR's fast path is checked against: DeAR
runs the layers before J without autograd, shares them with the frozen pass, and prepares the
text side before J once per class list, cut after the longest prompt; the reference does none
of that (full context, its own frozen passes, everything recomputed on every call), and the
two must agree in their outputs and in the gradients they give the learnable tensors.

Both token constructions go through it. Under tokens="shared" (MMRL++'s) the tokens of each
layer are not learnable tensors of their own but a map of A latent tokens, written here from
its description (`shared_layer_tokens`), layer by layer as MMRL++'s Residual_Aligner computes
it, and fed to the same reference; K = A = 3 there, so a K that did not follow A would show.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_DEEP, assert_close
import dear
from dear import DeAR, DeAROutput, HeadRole, RoleMap

# Attribute tokens in the map's own order (not the core order, so a bug that reorders shows).
ATTRIBUTES = ["texture", "colour", "shape"]
BETA, K = 0.3, 3
HEADS = TINY_DEEP["vision_heads"]
# Layer 0 is not in the map (mixed by the spec); layers 1 and 2 hold every role, differently.
ROLES = {
    1: ["colour", "G", "M", "texture"],
    2: ["G", "shape", "M", "colour"],
}


def role_map() -> RoleMap:
    heads = []
    for layer, tags in ROLES.items():
        for head, tag in enumerate(tags):
            if tag in ("G", "M"):
                heads.append(HeadRole(layer, head, {"G": "generalization", "M": "mixed"}[tag]))
            else:
                heads.append(HeadRole(layer, head, "attribute", tag))
    return RoleMap(TINY_DEEP["vision_layers"], HEADS, ATTRIBUTES, heads)


# ------------------------------------------------------------------------------------------
# The reference, from the spec
# ------------------------------------------------------------------------------------------


def allowed(tag: str, n_image: int, n_attr: int) -> torch.Tensor:
    """(N + A, N + A) bool, N = n_image, A = n_attr, row = query: who may attend to whom, for one
    head (the spec, METHOD.md Sec. 4)."""
    size = n_image + n_attr
    if tag == "M":
        return torch.ones(size, size, dtype=torch.bool)
    ok = torch.zeros(size, size, dtype=torch.bool)
    ok[:n_image, :n_image] = True
    for a in range(n_attr):
        ok[n_image + a, n_image + a] = True  # every attribute token sees itself
    if tag != "G":  # attribute head for `tag`: its token and the image see each other
        a = n_image + ATTRIBUTES.index(tag)
        ok[:n_image, a] = True
        ok[a, :n_image] = True
    return ok


def block(weights, prefix: str, x: torch.Tensor, heads: int, allow) -> torch.Tensor:
    """One pre-LN residual block, attention written per head. x (B, N, W), N its tokens, W the
    tower's width; allow: a list of (N, N) bool per head, or one (N, N) bool for every head."""
    w = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
    W = x.shape[-1]
    D = W // heads  # a head's width
    h = F.layer_norm(x, (W,), w("ln_1.weight"), w("ln_1.bias"), 1e-5)
    in_proj, b = w("attn.in_proj_weight"), w("attn.in_proj_bias")  # (3W, W), (3W,)
    outputs = []
    for head in range(heads):
        rows = slice(head * D, (head + 1) * D)
        q = h @ in_proj[rows].T + b[rows]  # (B, N, D)
        k = h @ in_proj[W:][rows].T + b[W:][rows]
        v = h @ in_proj[2 * W:][rows].T + b[2 * W:][rows]
        scores = torch.einsum("bqd,bkd->bqk", q, k) / math.sqrt(D)  # (B, N, N)
        mask = allow[head] if isinstance(allow, list) else allow
        scores = scores.masked_fill(~mask, float("-inf"))
        outputs.append(torch.einsum("bqk,bkd->bqd", scores.softmax(dim=-1), v))
    x = x + torch.cat(outputs, dim=-1) @ w("attn.out_proj.weight").T + w("attn.out_proj.bias")
    h = F.layer_norm(x, (W,), w("ln_2.weight"), w("ln_2.bias"), 1e-5)
    h = h @ w("mlp.c_fc.weight").T + w("mlp.c_fc.bias")
    h = h * torch.sigmoid(1.702 * h)  # QuickGELU
    return x + h @ w("mlp.c_proj.weight").T + w("mlp.c_proj.bias")


def reference(clip, tensors: dict, J: int, images: torch.Tensor, ids: torch.Tensor) -> dict:
    """Everything DeAR computes, from the spec. tensors: DeAR's learnable tensors (data)."""
    # In float64: the reference's own rounding then adds nothing to the fp32 model's.
    sd = {k: v.detach().double() for k, v in clip.state_dict().items()}
    tensors = {k: v.double() for k, v in tensors.items()}
    images = images.double()
    patch, W_v = TINY_DEEP["vision_patch_size"], TINY_DEEP["vision_width"]
    A, j = len(ATTRIBUTES), J - 1

    # Vision: patches, class token, positions, ln_pre.
    x = F.conv2d(images, sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)  # (B, G*G, W_v)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, W_v)
    x = torch.cat([cls, x], 1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, (W_v,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"], 1e-5)
    N = x.shape[1]  # 1 + G*G
    plain = x
    for layer in range(TINY_DEEP["vision_layers"]):
        plain = block(sd, f"visual.transformer.resblocks.{layer}", plain, HEADS, torch.ones(N, N, dtype=torch.bool))
    for layer in range(j):
        x = block(sd, f"visual.transformer.resblocks.{layer}", x, HEADS, torch.ones(N, N, dtype=torch.bool))
    out = None
    for i, layer in enumerate(range(j, TINY_DEEP["vision_layers"])):
        p = tensors["vision_tokens"][i].expand(x.shape[0], A, W_v)
        tokens = p if i == 0 else BETA * p + (1 - BETA) * out  # the MMRL++ rule
        tags = ROLES.get(layer, ["M"] * HEADS)
        masks = [allowed(tag, N, A) for tag in tags]
        sequence = block(sd, f"visual.transformer.resblocks.{layer}", torch.cat([x, tokens], 1), HEADS, masks)
        x, out = sequence[:, :N], sequence[:, N:]

    def ln_post(t):
        return F.layer_norm(t, (W_v,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"], 1e-5)

    f_cls = ln_post(x[:, 0]) @ sd["visual.proj"]
    f_attr = ln_post(out) @ tensors["attribute_proj"]
    frozen_image = ln_post(plain[:, 0]) @ sd["visual.proj"]

    # Text: the full context, causal; K tokens after the start token from layer J on.
    W_t = TINY_DEEP["transformer_width"]
    t = sd["token_embedding.weight"][ids] + sd["positional_embedding"]  # (C, N_t, W_t)
    N_t = t.shape[1]  # the text's tokens: the full context
    eot = ids.argmax(dim=-1)
    causal = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    plain_t = t
    for layer in range(TINY_DEEP["transformer_layers"]):
        plain_t = block(sd, f"transformer.resblocks.{layer}", plain_t, TINY_DEEP["transformer_heads"], causal(N_t))
    for layer in range(j):
        t = block(sd, f"transformer.resblocks.{layer}", t, TINY_DEEP["transformer_heads"], causal(N_t))
    for i, layer in enumerate(range(j, TINY_DEEP["transformer_layers"])):
        p = tensors["text_tokens"][i].expand(t.shape[0], K, W_t)
        if i == 0:
            t = torch.cat([t[:, :1], p, t[:, 1:]], 1)  # right after the start token
        else:
            t = torch.cat([t[:, :1], BETA * p + (1 - BETA) * t[:, 1:1 + K], t[:, 1 + K:]], 1)
        t = block(sd, f"transformer.resblocks.{layer}", t, TINY_DEEP["transformer_heads"], causal(N_t + K))

    def text_head(states, positions):
        states = F.layer_norm(states, (W_t,), sd["ln_final.weight"], sd["ln_final.bias"], 1e-5)
        return states[torch.arange(len(positions)), positions] @ sd["text_projection"]

    text = text_head(t, eot + K)
    frozen_text = text_head(plain_t, eot)

    # Logits: s * cos per branch, fused with alpha = softmax(w).
    scale = sd["logit_scale"].exp()
    features = torch.cat([f_cls[:, None], f_attr], 1)  # (B, 1 + A, E)
    cos = torch.einsum("bke,ce->bkc", features / features.norm(dim=-1, keepdim=True),
                       text / text.norm(dim=-1, keepdim=True))
    branch = scale * cos
    alpha = tensors["fusion_logits"].exp() / tensors["fusion_logits"].exp().sum()
    fused = (branch * alpha[None, :, None]).sum(1)
    result = dict(f_cls=f_cls, f_attr=f_attr, text=text, branch=branch, fused=fused,
                  frozen_image=frozen_image, frozen_text=frozen_text)
    return {k: v.float() for k, v in result.items()}


# The shared construction (tokens="shared"), from its description: A latent tokens z (A, R); per
# tower one linear map M (W, R), W that tower's width, for all its layers, and per layer l a rank-4
# residual a_l b_l and a bias c_l of its own: p_l = z (M + a_l b_l)^T + c_l, for every layer from
# J on in both towers. The attribute projection: the frozen proj plus a rank-64 residual a b.
def shared_layer_tokens(latent, weight, a, b, bias) -> torch.Tensor:
    """(L, A, W) (L_v or L_t layers, W_v or W_t): one layer at a time, the residual added to the
    weight first."""
    z = latent.double()
    weight, a, b, bias = weight.double(), a.double(), b.double(), bias.double()
    return torch.stack([F.linear(z, weight + a[l] @ b[l], bias[l]) for l in range(len(a))])


def reference_tensors(model: DeAR) -> dict:
    """What `reference` reads, from the model's learnable tensors (with their autograd graph):
    under "shared", each layer's tokens and the projection computed from the shared tensors."""
    t = model.learnable_tensors()
    if model.construction == "separate":
        return t
    def aligner(tower: str) -> list:
        return [t[f"{tower}_aligner.{n}"] for n in ("weight", "a", "b", "bias")]

    residual = t["attribute_proj_residual.a"].double() @ t["attribute_proj_residual.b"].double()
    return dict(vision_tokens=shared_layer_tokens(t["latent_tokens"], *aligner("vision")),
                text_tokens=shared_layer_tokens(t["latent_tokens"], *aligner("text")),
                attribute_proj=model.clip.visual.proj.double() + residual,
                fusion_logits=t["fusion_logits"])


# ------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------


def prompts(num_classes=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(num_classes, TINY_DEEP["context_length"], dtype=torch.long)
    for c in range(num_classes):
        length = 3 + c % 4
        ids[c, 0] = TINY_DEEP["vocab_size"] - 2
        ids[c, 1:length] = torch.randint(1, TINY_DEEP["vocab_size"] - 2, (length - 1,), generator=generator)
        ids[c, length] = TINY_DEEP["vocab_size"] - 1
    return ids


def randomised(clip, J: int, tokens: str = "separate") -> DeAR:
    torch.manual_seed(10 + J)
    if tokens == "shared":  # K unset: it must follow A (= K = 3 here)
        model = DeAR(clip, role_map(), ATTRIBUTES, first_layer=J, beta=BETA, tokens=tokens)
        return randomised_shared(model)
    model = DeAR(clip, role_map(), ATTRIBUTES, first_layer=J, beta=BETA, num_text_tokens=K)
    with torch.no_grad():
        model.tokens.vision_tokens.normal_(0, 1.0)
        model.tokens.text_tokens.normal_(0, 1.0)
        model.tokens.attribute_proj.add_(torch.randn_like(model.tokens.attribute_proj) * 0.05)  # ~ the size of proj itself
        model.fusion_logits.copy_(torch.randn_like(model.fusion_logits))
    return model


def randomised_shared(model: DeAR) -> DeAR:
    """Every shared tensor away from its start (B = 0 would hide a residual applied wrongly), each
    layer's bias its own; tokens of about unit size, as the separate ones above."""
    with torch.no_grad():
        model.tokens.latent_tokens.normal_(0, 1.0)
        for aligner in (model.tokens.vision_aligner, model.tokens.text_aligner):
            aligner.weight.mul_(8.0)  # torch's init is ~1/sqrt(R): mapped tokens of order 1
            aligner.a.normal_(0, 0.5)
            aligner.b.normal_(0, 0.5)
            aligner.bias.normal_(0, 0.5)
        residual = model.tokens.attribute_proj_residual
        residual.a.normal_(0, 0.05)
        residual.b.normal_(0, 0.05)  # a b of about the size of proj's entries
        model.fusion_logits.copy_(torch.randn_like(model.fusion_logits))
    return model


@pytest.mark.parametrize("tokens", ["separate", "shared"])
@pytest.mark.parametrize("J", [1, 2, 3])
def test_dear_matches_the_reference_forward(tiny_deep_clip, J, tokens):
    model = randomised(tiny_deep_clip, J, tokens)
    assert model.blind_attributes == []  # every branch is in the fusion (mixed heads exist from J on)
    generator = torch.Generator().manual_seed(3)
    images = torch.randn(3, 3, TINY_DEEP["image_resolution"], TINY_DEEP["image_resolution"], generator=generator)
    ids = prompts()
    with torch.no_grad():
        out = model(images, model.prepare_classes(ids), with_frozen=True)
        ref = reference(tiny_deep_clip, reference_tensors(model), J, images, ids)
    assert_close(out.image_features[:, 0], ref["f_cls"], 1e-5, f"J={J}: class feature")
    assert_close(out.image_features[:, 1:], ref["f_attr"], 1e-5, f"J={J}: attribute features")
    assert_close(out.text_features, ref["text"], 1e-5, f"J={J}: text features")
    assert_close(out.branch_logits, ref["branch"], 1e-5, f"J={J}: branch logits")
    assert_close(out.logits, ref["fused"], 1e-5, f"J={J}: fused logits")
    assert_close(out.frozen_image_features, ref["frozen_image"], 1e-5, f"J={J}: frozen image feature")
    assert_close(out.frozen_text_features, ref["frozen_text"], 1e-5, f"J={J}: frozen text feature")
    # The comparison has teeth: the learned pieces move every output away from plain CLIP.
    assert (out.image_features[:, 0] - ref["frozen_image"]).abs().max() > 1e-3
    assert (out.text_features - ref["frozen_text"]).abs().max() > 1e-3


@pytest.mark.parametrize("tokens", ["separate", "shared"])
@pytest.mark.parametrize("J", [1, 2, 3])
def test_the_fast_path_equals_the_plain_reference_gradients_included(tiny_deep_clip, J, tokens):
    model = randomised(tiny_deep_clip, J, tokens)
    generator = torch.Generator().manual_seed(4)
    images = torch.randn(3, 3, TINY_DEEP["image_resolution"], TINY_DEEP["image_resolution"], generator=generator)
    ids, labels = prompts(5), torch.tensor([0, 4, 2])
    # The reference, with grad: it reads DeAR's learnable tensors themselves, so the loss on its
    # outputs -- written out here from the spec, not dear_loss -- gives them the plain
    # computation's gradients.
    ref = reference(tiny_deep_clip, reference_tensors(model), J, images, ids)
    alpha = model.fusion_logits.softmax(dim=0)
    plain = DeAROutput(ref["fused"], ref["branch"], alpha, torch.cat([ref["f_cls"][:, None], ref["f_attr"]], 1),
                       ref["text"], ref["frozen_image"], ref["frozen_text"])
    reg = (1 - F.cosine_similarity(ref["f_cls"], ref["frozen_image"], dim=-1)).mean() \
        + (1 - F.cosine_similarity(ref["text"], ref["frozen_text"], dim=-1)).mean()
    (F.cross_entropy(ref["fused"], labels) + 2.0 * reg - 0.5 * torch.log(alpha[0])).backward()
    plain_grads = [p.grad.clone() for p in model.learnable_parameters()]
    assert all(g.abs().max() > 0 for g in plain_grads)
    # The fast path, twice on one prepared class list: the second step must reuse it unchanged.
    classes = model.prepare_classes(ids)
    for step in (1, 2):
        for p in model.learnable_parameters():
            p.grad = None
        out = model(images, classes, with_frozen=True)
        dear.dear_loss(out, labels, lambda_reg=2.0, lambda_fusion=0.5)["total"].backward()
        for name in ("logits", "text_features", "frozen_image_features", "frozen_text_features"):
            expected = getattr(plain, name).detach()
            assert_close(getattr(out, name).detach(), expected, 1e-5, f"J={J}, step {step}: {name}")
        assert_close(out.image_features.detach(), plain.image_features.detach(), 1e-5, f"J={J}: image features")
        for (name, p), g in zip(model.learnable_tensors().items(), plain_grads):
            scale = max(1.0, g.abs().max().item())
            what = f"J={J}, step {step}: {name}'s gradient (relative)"
            assert_close(p.grad / scale, g / scale, 1e-5, what)


# ------------------------------------------------------------------------------------------
# The shared construction's own properties, read through the reference's map
# ------------------------------------------------------------------------------------------


def test_at_the_start_every_layers_tokens_are_equal_and_the_projection_is_proj(tiny_deep_clip):
    torch.manual_seed(0)
    model = DeAR(tiny_deep_clip, role_map(), ATTRIBUTES, first_layer=1, beta=BETA, tokens="shared")
    with torch.no_grad():
        tensors = reference_tensors(model)
        towers = (("vision", model.tokens.vision_layer_tokens()), ("text", model.tokens.text_layer_tokens()))
        for tower, ours in towers:
            theirs = tensors[f"{tower}_tokens"]
            assert ours.shape == (3, len(ATTRIBUTES), 128), tower
            assert_close(ours.double(), theirs, 1e-6, f"{tower}: the map at the start")
            for layer in range(1, len(ours)):  # B = 0 and one bias copied to every layer
                assert torch.equal(ours[layer], ours[0]), f"{tower} layer {layer} differs"
        assert torch.equal(model.tokens.attribute_projection(tiny_deep_clip.visual.proj), tiny_deep_clip.visual.proj)  # B = 0
        assert model.tokens.latent_tokens.std().item() == pytest.approx(0.02, rel=0.25)  # MMRL++'s init


def test_one_layers_residual_moves_that_layers_tokens_only(tiny_deep_clip):
    model = randomised(tiny_deep_clip, 1, "shared")
    with torch.no_grad():
        before_v, before_t = model.tokens.vision_layer_tokens().clone(), model.tokens.text_layer_tokens().clone()
        model.tokens.vision_aligner.b[1] += 0.3  # layer 2's residual, vision tower
        after_v, after_t = model.tokens.vision_layer_tokens(), model.tokens.text_layer_tokens()
        expected = reference_tensors(model)["vision_tokens"]
        assert_close(after_v.double(), expected, 1e-5, "after the change")
    assert (after_v[1] - before_v[1]).abs().max() > 1e-2, "the changed layer did not move"
    for layer in (0, 2):
        assert torch.equal(after_v[layer], before_v[layer]), f"layer {layer} moved"
    assert torch.equal(after_t, before_t), "the text tower moved"


def test_changing_a_latent_token_moves_both_towers(tiny_deep_clip):
    model = randomised(tiny_deep_clip, 2, "shared")
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    classes = model.prepare_classes(prompts())
    with torch.no_grad():
        before = model(images, classes)
        model.tokens.latent_tokens[1] += 0.5  # the colour token's latent
        after = model(images, classes)
    moved = (after.image_features[:, 2] - before.image_features[:, 2]).abs().max()
    assert moved > 1e-3, "vision tower"
    assert (after.text_features - before.text_features).abs().max() > 1e-3, "text tower"
