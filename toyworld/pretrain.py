"""
toyworld/pretrain.py -- pretrain a tiny CLIP on the toy world from scratch, on a CPU, and keep it
in a cache in OpenAI's formats.

    1. configurations ...... "full" (48 px, 4+3 layers of 8 heads, ~1.6M parameters, ~11
                             minutes) and "miniature" (the tests')
    2. data ................ images drawn fresh every batch, with their captions
    3. zero-shot ........... per-attribute accuracy with partial-caption prompts
    4. the loss ............ CLIP's symmetric InfoNCE with a learnable, clamped temperature
    5. the training loop ... AdamW, warm-up then cosine, a fixed step budget, progress lines
    6. the cache ........... <cache>/toyworld/<config name>/{clip.pt, bpe.txt.gz, config.json}
    7. the shipped model ... toyworld/assets/full/, checked by SHA-256, used instead of pretraining

The checkpoint is a plain `state_dict()` of `clip_model.CLIP` (OpenAI's key names): train.py
loads it with `clip_model.load(path, head_width=...)` as it loads ViT-B/16. Nothing downstream
knows the model is a toy.

Try it:  python -m toyworld.pretrain --scale miniature              (a few seconds)
         python -m toyworld.pretrain --scale full --rebuild    (about 11 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import clip_model
import data
from harness import files
from toyworld import world
from toyworld.bpe import write_bpe

CACHE_FORMAT = "dear-from-scratch toy CLIP cache, version 1"


# ---- 1. Configurations -------------------------------------------------------------------
@dataclass(frozen=True)
class PretrainConfig:
    name: str  # the cache folder's name
    # -- the model (clip_model.CLIP's constructor arguments, less the vocabulary) --
    image_size: int = 48  # pixels; the toy world draws at this size, no resizing anywhere
    # 48 / 12 = 4 x 4 patches + CLS = 17 tokens, as 32 px with patch 8 (+7% per step), but at
    # 32 px a small star was 8 pixels across and shape zero-shot stayed near 70%.
    patch_size: int = 12
    vision_width: int = 128
    vision_layers: int = 4
    text_width: int = 128
    text_layers: int = 3
    # Both towers: width / head_width heads; 8 of 16 rather than 4 of 32 lets some specialise.
    head_width: int = 16
    embed_dim: int = 128
    context_length: int = 24  # the longest caption is 17 tokens + start and end
    # -- the optimisation --
    batch_size: int = 64  # small batches beat large ones at equal time here (more steps)
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 200
    # A fixed number of steps, never a clock: the same settings give the same model however
    # busy or slow the machine is (with the same torch build); a slow one only takes longer.
    max_steps: int = 3200
    # One thread, fixed for the build and restored afterwards: the result must not depend on
    # the core count, and on a shared machine one thread is also the fastest (measured on 2
    # cores: 2 threads 466 images/s alone but 45 next to one busy process; one thread 335, 201).
    threads: int = 1
    twin_share: float = 0.5  # share of each batch drawn as "twin" pairs (see training_scenes)
    position_init_std: float = 0.25  # image positional embedding init (OpenAI: width**-0.5); see build_clip
    bf16: bool = False  # bf16 autocast on CPU: measured no faster (docs/MEASURED.md)
    # -- bookkeeping --
    eval_images: int = 512  # a fixed set for the zero-shot lines
    eval_every: int = 500  # steps between zero-shot lines
    log_every: int = 100  # steps between loss lines
    seed: int = 0


CONFIGS = {
    "full": PretrainConfig("full"),
    # For the tests: 16 px, 2 + 1 layers of width 64, 30 steps: it learns almost nothing, in seconds.
    "miniature": PretrainConfig(
        "miniature", image_size=16, patch_size=4, vision_width=64, vision_layers=2, text_width=64,
        text_layers=1, head_width=32, embed_dim=64, batch_size=32, warmup_steps=5, max_steps=30,
        eval_images=64, eval_every=15, log_every=10),
}


# Seconds expected on 2 quiet cores (docs/MEASURED.md: 0.19 s per step on one thread); a
# build that looks much slower says how long it will take. Not in the config: no effect on the model.
EXPECTED_SECONDS = {"full": 610.0}


def build_clip(config: PretrainConfig, vocab_size: int) -> clip_model.CLIP:
    """A freshly initialised CLIP (OpenAI's initialisation) of the config's shape, except for
    the image positional embedding (see below)."""
    model = clip_model.CLIP(
        embed_dim=config.embed_dim, image_resolution=config.image_size,
        vision_layers=config.vision_layers, vision_width=config.vision_width,
        vision_patch_size=config.patch_size, vision_heads=config.vision_width // config.head_width,
        context_length=config.context_length, vocab_size=vocab_size,
        transformer_width=config.text_width, transformer_heads=config.text_width // config.head_width,
        transformer_layers=config.text_layers)
    # OpenAI's std width**-0.5 (0.09 here) makes position a ~15% ripple on patch embeddings of
    # std ~0.5; with it (and weight decay on it) position zero-shot stayed at chance for a whole
    # 9-minute run. Measured (docs/MEASURED.md): std 0.5 gets position to 100% by 32k images
    # but leaves shape at chance; 0.25 is the compromise.
    with torch.no_grad():
        model.visual.positional_embedding.normal_(std=config.position_init_std)
    return model


# ---- 2. Data: images drawn fresh every batch ---------------------------------------------
_MEAN = torch.tensor(data.CLIP_MEAN).view(1, 3, 1, 1)
_STD = torch.tensor(data.CLIP_STD).view(1, 3, 1, 1)


def to_model_input(images: np.ndarray) -> torch.Tensor:
    """uint8 (B, S, S, 3) -> float (B, 3, S, S), exactly what data.test_transform(S) makes of
    the same pixels saved as a PNG (Resize and CenterCrop are the identity at size S)."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0  # (B, 3, S, S) in [0, 1]
    return (x - _MEAN) / _STD


def draw_batch(seed: int, n: int, size: int, style: str = "pretrain") -> tuple[torch.Tensor, list[world.Scene]]:
    """n scenes drawn from `seed` and their images: ((n, 3, size, size) model input, scenes)."""
    scene_rng = random.Random(seed)
    scenes = [world.sample_scene(scene_rng) for _ in range(n)]
    return to_model_input(world.render_batch(scenes, np.random.default_rng(seed), size, style)), scenes


def training_scenes(rng: random.Random, n: int, twin_share: float) -> list[world.Scene]:
    """n scenes for one training batch, shuffled: about twin_share of them in twin pairs (a
    scene and a copy with one core attribute redrawn), the rest drawn independently.

    Why twins: among independent scenes a full caption is almost always told apart by colour
    and texture alone, the attributes learnt first, so shape gets little pressure. A twin that
    differs only in shape makes shape the only way to match the pair's two captions."""
    n_pairs = int(n * twin_share) // 2
    scenes = []
    for _ in range(n_pairs):
        scene = world.sample_scene(rng)
        attribute = rng.choice(list(world.ATTRIBUTES))
        other = rng.choice([v for v in world.ATTRIBUTES[attribute] if v != scene.value(attribute)])
        scenes += [scene, replace(scene, **{attribute: other})]
    scenes += [world.sample_scene(rng) for _ in range(n - len(scenes))]
    rng.shuffle(scenes)
    return scenes


# ---- 3. Zero-shot accuracy per attribute -------------------------------------------------
@torch.no_grad()
def prompt_features(model: clip_model.CLIP, tokenizer: clip_model.SimpleTokenizer,
                    attributes: Sequence[str]) -> dict[str, torch.Tensor]:
    """For each attribute, the normalised text embeddings of its zero-shot prompts,
    (n_values, E), in the attribute table's value order."""
    return {name: F.normalize(model.encode_text(
        tokenizer.tokenize(world.attribute_prompts(name), model.context_length)), dim=-1)
        for name in attributes}


@torch.no_grad()
def zero_shot_scores(model: clip_model.CLIP, images: torch.Tensor, scenes: Sequence[world.Scene],
                     text: dict[str, torch.Tensor], embeddings: Optional[torch.Tensor] = None
                     ) -> dict[str, dict[str, float]]:
    """Per attribute of `text` (from prompt_features): {"accuracy": share of images whose
    best-matching prompt names their value, "log_prob": mean log-probability of the true value
    under CLIP's softmax over the prompts}. The log-probability keeps moving when accuracy is
    already 100%, which the ablation check (causal.py, which passes edited `embeddings`) needs."""
    image_features = F.normalize(model.encode_image(images) if embeddings is None else embeddings, dim=-1)  # (B, E)
    scale = model.logit_scale.exp()
    result = {}
    for name, prompts in text.items():
        truth = torch.tensor([world.VALUES[name].index(scene.value(name)) for scene in scenes])  # (B,)
        log_probs = (scale * image_features @ prompts.T).log_softmax(dim=-1)  # (B, n_values)
        result[name] = {"accuracy": (log_probs.argmax(dim=-1) == truth).float().mean().item(),
                        "log_prob": log_probs.gather(1, truth[:, None]).mean().item()}
    return result


# ---- 4. The loss: CLIP's symmetric InfoNCE -----------------------------------------------
def contrastive_loss(image_features: torch.Tensor, text_features: torch.Tensor,
                     logit_scale: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """CLIP's loss (Radford et al. 2021, Fig. 3): cross-entropy over the batch in both
    directions, image -> its caption and caption -> its image. image_features, text_features:
    (B, E), not normalised; logit_scale: log of the temperature s (clamped at 100, as CLIP);
    positives: (B, B) bool, [i, j] = caption j is true of image i.

    The one change from CLIP: a partial caption such as "a red object" is true of *every* red
    image in the batch, so each row's target is spread evenly over its positives (the diagonal
    always is one) instead of one-hot; for distinct scenes' full captions it is CLIP's loss."""
    image_features = F.normalize(image_features, dim=-1)
    text_features = F.normalize(text_features, dim=-1)
    scale = logit_scale.clamp(max=math.log(100.0)).exp()
    logits = scale * image_features @ text_features.T  # (B_img, B_txt)
    targets = positives.float()
    image_to_text = F.cross_entropy(logits, targets / targets.sum(1, keepdim=True))
    text_to_image = F.cross_entropy(logits.T, targets.T / targets.T.sum(1, keepdim=True))
    return (image_to_text + text_to_image) / 2


# ---- 5. The training loop ----------------------------------------------------------------
def learning_rate(config: PretrainConfig, step: int) -> float:
    """Linear warm-up over warmup_steps, then a cosine from lr to 0 at max_steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(config.max_steps - config.warmup_steps, 1)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def pretrain(config: PretrainConfig, tokenizer: clip_model.SimpleTokenizer,
             log: Callable[[str], None] = print) -> tuple[clip_model.CLIP, dict[str, float]]:
    """Train a fresh CLIP on freshly drawn toy images for config.max_steps steps on
    config.threads threads (the caller's count is restored); return it (eval mode) and its last
    zero-shot accuracy per attribute. Logs a loss line every log_every steps (with the time
    left) and a zero-shot line every eval_every."""
    callers_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(config.seed)
        model = build_clip(config, tokenizer.vocab_size)
        n_parameters = sum(p.numel() for p in model.parameters())
        log(f"toy CLIP '{config.name}': {n_parameters:,} parameters; {config.image_size}px images, "
            f"patch {config.patch_size}, vision {config.vision_layers} layers x "
            f"{config.vision_width // config.head_width} heads of {config.head_width}, text "
            f"{config.text_layers} layers, vocabulary {tokenizer.vocab_size}")
        log(f"toy CLIP '{config.name}': {config.max_steps} steps of {config.batch_size} images on "
            f"{config.threads} thread(s), {'bf16 autocast' if config.bf16 else 'fp32'}")

        # No weight decay on 1-D tensors (gains, biases, the temperature), nor on the embeddings
        # (timm's rule for pos_embed / cls_token): decay pulls the positional embedding, the only
        # thing that says where an object is, towards zero.
        embeddings = {id(model.visual.positional_embedding), id(model.visual.class_embedding),
                      id(model.positional_embedding), id(model.token_embedding.weight)}
        decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in embeddings]
        no_decay = [p for p in model.parameters() if p.ndim < 2 or id(p) in embeddings]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=config.lr)

        scene_rng, pixel_rng = random.Random(config.seed), np.random.default_rng(config.seed)
        # A fixed evaluation set from its own seed: every zero-shot line measures the same images.
        eval_images, eval_scenes = draw_batch(10_000 + config.seed, config.eval_images, config.image_size)
        expected = EXPECTED_SECONDS.get(config.name, 0.0)
        start = time.time()
        loss_sum, loss_count, accuracy = 0.0, 0, {}
        for step in range(1, config.max_steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step - 1)

            # A fresh batch: scenes, their images, and a caption per image naming random attributes.
            scenes = training_scenes(scene_rng, config.batch_size, config.twin_share)
            images = to_model_input(world.render_batch(scenes, pixel_rng, config.image_size))
            named = [world.random_naming(scene_rng) for _ in scenes]
            captions = [world.random_caption(scene, scene_rng, n) for scene, n in zip(scenes, named)]
            positives = torch.tensor([[world.describes(scenes[j], named[j], scenes[i]) for j in range(len(scenes))]
                                      for i in range(len(scenes))])  # (B, B): caption j true of image i

            model.train()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                image_features = model.encode_image(images)  # (B, E)
                text_features = model.encode_text(tokenizer.tokenize(captions, config.context_length))  # (B, E)
            loss = contrastive_loss(image_features.float(), text_features.float(), model.logit_scale, positives)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1

            last = step == config.max_steps
            if step % config.log_every == 0 or last:
                elapsed = time.time() - start
                left = (config.max_steps - step) * elapsed / step  # at the pace so far
                log(f"  step {step:>5}/{config.max_steps}  loss {loss_sum / loss_count:.3f}  "
                    f"lr {optimizer.param_groups[0]['lr']:.2e}  scale {model.logit_scale.exp().item():5.1f}  "
                    f"{step * config.batch_size / elapsed:,.0f} images/s  {elapsed:.0f} s elapsed, ~{left:.0f} s left")
                loss_sum, loss_count = 0.0, 0
                if step == config.log_every and expected and left + elapsed > 1.5 * expected:
                    # Slow or busy machine: the build is not cut short (the model would differ),
                    # it takes longer. Say so once, early.
                    log(f"  this machine is running slower than the ~{expected / 60:.0f} minutes expected on "
                        f"2 quiet cores: pretraining will take about {(left + elapsed) / 60:.0f} minutes "
                        "(the same model either way)")
            if step % config.eval_every == 0 or last:
                model.eval()
                text = prompt_features(model, tokenizer, world.ATTRIBUTES)
                scores = zero_shot_scores(model, eval_images, eval_scenes, text)
                accuracy = {name: score["accuracy"] for name, score in scores.items()}
                log("  zero-shot " + "  ".join(f"{name} {value:.0%}" for name, value in accuracy.items())
                    + f"  (chance: {'  '.join(f'{1 / len(v):.0%}' for v in world.ATTRIBUTES.values())})")
        model.eval()
        log(f"pretraining done: {config.max_steps} steps, {config.max_steps * config.batch_size:,} images, "
            f"{time.time() - start:.0f} s")
        return model, accuracy
    finally:
        torch.set_num_threads(callers_threads)


# ---- 6. The cache ------------------------------------------------------------------------
# <cache>/toyworld/<name>/: bpe.txt.gz, then clip.pt (clip_model.save), then config.json (the
# config, the world's fingerprint, the report). Every file is written atomically, so a folder
# whose config.json matches the current settings is complete.


@dataclass
class CachedCLIP:
    weights: str  # clip.pt
    bpe: str  # bpe.txt.gz
    head_width: int
    report: dict  # what config.json records: parameters, seconds, zero-shot accuracy


def cache_folder(config: PretrainConfig, cache_dir: Optional[str] = None) -> str:
    return os.path.join(cache_dir or clip_model.default_cache_dir(), "toyworld", config.name)


def _check_cache(folder: str, config: PretrainConfig) -> tuple[Optional[dict], str]:
    """(the config.json record, "") if the folder holds a complete, loadable model made with
    `config`, else (None, the reason)."""
    record_path = os.path.join(folder, "config.json")
    if not os.path.isfile(record_path):
        return None, "no config.json (never built, or a build was interrupted)"
    try:
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as error:
        return None, f"config.json unreadable ({type(error).__name__})"
    if not isinstance(record, dict):
        return None, "config.json is JSON of the wrong shape"
    if record.get("format") != CACHE_FORMAT or record.get("config") != asdict(config):
        return None, "config.json was made with other settings"
    if record.get("world") != world.fingerprint():
        return None, "config.json was made from another version of the world (world.py's tables)"
    try:
        tokenizer = clip_model.SimpleTokenizer(os.path.join(folder, "bpe.txt.gz"))
        model, _ = clip_model.load(os.path.join(folder, "clip.pt"), head_width=config.head_width)
    except clip_model.CLIPFileError as error:
        return None, str(error)
    if model.token_embedding.num_embeddings != tokenizer.vocab_size:
        return None, f"the model's vocabulary ({model.token_embedding.num_embeddings}) is not the BPE's ({tokenizer.vocab_size})"
    return record, ""


def pretrained_clip(config: PretrainConfig, cache_dir: Optional[str] = None,
                    log: Callable[[str], None] = print, rebuild: bool = False) -> CachedCLIP:
    """The toy CLIP for `config`: the shipped one if the repository holds it (section 7),
    else the cached one, pretrained (and cached) first if the cache is missing or cannot be
    trusted. rebuild=True pretrains it afresh in the cache whatever is shipped or cached."""
    shipped = None if rebuild else shipped_clip(config, log)
    if shipped is not None:
        return shipped
    folder = cache_folder(config, cache_dir)
    weights, bpe = os.path.join(folder, "clip.pt"), os.path.join(folder, "bpe.txt.gz")
    record, problem = (None, "--rebuild") if rebuild else _check_cache(folder, config)
    if record is not None:
        log(f"toy CLIP '{config.name}': reusing the cached model in {folder}")
        return CachedCLIP(weights, bpe, config.head_width, record.get("report", {}))

    log(f"toy CLIP '{config.name}': building it in {folder} ({problem})")
    if os.path.exists(os.path.join(folder, "config.json")):
        os.remove(os.path.join(folder, "config.json"))  # the folder is incomplete until we finish
    vocab_size = write_bpe(world.corpus(), bpe)
    tokenizer = clip_model.SimpleTokenizer(bpe)
    assert tokenizer.vocab_size == vocab_size, f"BPE file gives {tokenizer.vocab_size} ids, expected {vocab_size}"

    started = time.time()
    model, zero_shot = pretrain(config, tokenizer, log)  # the last zero-shot line's figures
    seconds = time.time() - started
    # The model depends on the settings, the torch build and the CPU's kernels only.
    report = {"parameters": sum(p.numel() for p in model.parameters()), "steps": config.max_steps,
              "images": config.max_steps * config.batch_size, "threads": config.threads,
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "pretrain_seconds": round(seconds, 1),
              "zero_shot": {k: round(v, 4) for k, v in zero_shot.items()}}
    clip_model.save(model, weights)  # atomic; same tensors = same bytes
    text = json.dumps({
        "format": CACHE_FORMAT,
        "load_with": f"clip_model.load('clip.pt', head_width={config.head_width}); "
                     "clip_model.SimpleTokenizer('bpe.txt.gz')",
        "head_width": config.head_width, "vocab_size": vocab_size, "config": asdict(config),
        "world": world.fingerprint(), "report": report}, indent=2, ensure_ascii=False) + "\n"
    files.write_text(os.path.join(folder, "config.json"), text)  # atomic, the file closed before the rename
    return CachedCLIP(weights, bpe, config.head_width, report)


# ---- 7. The shipped model ----------------------------------------------------------------
# A build's last bits depend on the CPU: torch's kernels (ATEN_CPU_CAPABILITY) and MKL add in
# another order on another instruction set, and 3,200 steps turn 1e-7 into another model
# (docs/MEASURED.md, "Same model everywhere"). So the repository ships the model the docs were
# measured on, in the cache's layout; `python -m toyworld --rebuild` builds it again and compares.

SHIPPED_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
SHIPPED_SHA256 = {
    "full": {"clip.pt": "41910ee78eecbf8b8652c19644675d437e744a44213782794f524831c3b2a92e",
             "bpe.txt.gz": "356e67f33049fa9795c17d57747ece196f659f27732d2154cb4bd866384c513d",
             "config.json": "5051b8fec273cbfb2ec1ee0da53e05f3fb3e3a8da864155b7c96eaaec6226fde"},
}


def _shipped_record(name: str) -> dict:
    with open(os.path.join(SHIPPED_FOLDER, name, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def shipped_clip(config: PretrainConfig, log: Callable[[str], None] = print) -> Optional[CachedCLIP]:
    """The shipped model for `config` (toyworld/assets/<name>/), its files checked by SHA-256;
    None when none is shipped for it or it was made with other settings or another world. A
    shipped file missing or altered is an error: silently building another model is what
    shipping avoids."""
    if config.name not in SHIPPED_SHA256:
        return None
    folder = os.path.join(SHIPPED_FOLDER, config.name)
    for name, expected in SHIPPED_SHA256[config.name].items():
        path = os.path.join(folder, name)
        actual = clip_model._sha256(path) if os.path.isfile(path) else None  # noqa: SLF001 -- the one hasher
        if actual != expected:
            problem = ("missing; it is part of the repository" if actual is None else
                       f"SHA-256 {actual[:16]}... is not the shipped file's {expected[:16]}... "
                       "(a Git LFS pointer or a damaged copy?); restore it")
            raise clip_model.CLIPFileError(f"{path}: {problem} (git checkout -- {path}), "
                                           "or build the model yourself with python -m toyworld --rebuild")
    record = _shipped_record(config.name)
    if record.get("config") != asdict(config) or record.get("world") != world.fingerprint():
        log(f"toy CLIP '{config.name}': the shipped model in {folder} was made with other settings "
            "or another version of the world; building one instead")
        return None
    log(f"toy CLIP '{config.name}': the shipped model {os.path.join(folder, 'clip.pt')} "
        f"(SHA-256 {SHIPPED_SHA256[config.name]['clip.pt'][:16]}...)")
    return CachedCLIP(os.path.join(folder, "clip.pt"), os.path.join(folder, "bpe.txt.gz"),
                      config.head_width, record.get("report", {}))


def compare_with_shipped(weights: str, bpe: str, name: str) -> str:
    """One line: is the model in `weights` + `bpe` (a build of config `name`) the shipped
    one, bit for bit? If not, how far from it."""
    if name not in SHIPPED_SHA256:
        return f"no shipped model for '{name}' to compare with"
    expected = SHIPPED_SHA256[name]
    if clip_model._sha256(bpe) != expected["bpe.txt.gz"]:  # noqa: SLF001
        return "another BPE file than the shipped one (another world or BPE trainer): another model"
    if clip_model._sha256(weights) == expected["clip.pt"]:  # noqa: SLF001
        return f"the build is the shipped model, bit for bit (SHA-256 {expected['clip.pt']})"
    built, shipped = (torch.load(path, map_location="cpu", weights_only=True)
                      for path in (weights, os.path.join(SHIPPED_FOLDER, name, "clip.pt")))
    tensors = [key for key, value in shipped.items() if isinstance(value, torch.Tensor)]
    differ = [key for key in tensors if key not in built or built[key].shape != shipped[key].shape
              or not torch.equal(built[key], shipped[key])]
    if not differ:
        return ("the build holds the shipped model's tensors bit for bit, in a file that differs "
                "(another torch version's file format)")
    largest = max(((built[key] - shipped[key]).abs().max().item() for key in differ
                   if key in built and built[key].shape == shipped[key].shape), default=float("inf"))
    made = _shipped_record(name).get("report", {})
    return (f"the build is another model: {len(differ)} of {len(tensors)} tensors differ from the "
            f"shipped ones, by up to {largest:.2g} (built with torch {torch.__version__}, CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()}; the shipped one with torch {made.get('torch', '?')}, "
            f"CPU kernels {made.get('cpu_capability', '?')})")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Pretrain (or reuse) the toy world's tiny CLIP.")
    parser.add_argument("--scale", default="full", choices=sorted(CONFIGS), help="which configuration")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $CLIP_CACHE_DIR or ~/.cache/clip-from-scratch)")
    parser.add_argument("--steps", type=int, default=None, help="override the step budget")
    parser.add_argument("--bf16", action="store_true", help="use bf16 autocast (measure first: often slower on CPU)")
    parser.add_argument("--rebuild", action="store_true", help="pretrain afresh in the cache, even where a model is shipped")
    args = parser.parse_args(argv)
    steps = {} if args.steps is None else {"max_steps": args.steps}
    config = replace(CONFIGS[args.scale], bf16=args.bf16, **steps)  # both configs: bf16=False
    cached = pretrained_clip(config, args.cache_dir, rebuild=args.rebuild)
    if args.rebuild:
        print(compare_with_shipped(cached.weights, cached.bpe, config.name))
    print(json.dumps({"weights": cached.weights, "bpe": cached.bpe, "head_width": cached.head_width,
                      **cached.report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
