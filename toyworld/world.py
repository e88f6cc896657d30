"""
toyworld/world.py -- the toy world itself: what a scene is, how it is drawn, how it is described.

    1. the attribute table ..... ATTRIBUTES (one DeAR attribute token each), EXTRA_ATTRIBUTES
    2. scenes .................. Scene (the attribute values of one image), sample_scene(rng)
    3. the renderer ............ render / render_batch -> (size, size, 3) uint8 (numpy, vectorised)
    4. captions ................ caption(scene, named=...) -> "a photo of a red object", ...
    5. the description bank .... toy_bank(): (text, concept, value), labelled by construction
    6. the corpus .............. every caption word and bank phrase, for the BPE trainer

Every image's attribute values are known, because the image is drawn from them: that is what
lets the toy world *measure* whether a head that concept entropy calls "colour" really
carries colour (docs/METHOD.md Sec. 8). The grammar is deliberately tiny: the article is
always "a" ("a orange circle"), words come in one fixed order, the only punctuation is an
optional final ".", and a caption that names no shape says "object".

Try it:  python -m toyworld.world     (prints a few scenes with their captions)
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, fields, replace
from typing import Iterable, Optional, Sequence

import numpy as np


# ---- 1. The attribute table --------------------------------------------------------------
# The core attributes, in token order: DeAR gets one attribute token per entry (docs/METHOD.md
# Sec. 4; the toy world's stand-ins for the paper's colour, shape, texture, object, location).
# Each value is a word (or words) the captions use.

ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "colour": ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink"),
    "shape": ("circle", "square", "triangle", "diamond", "cross", "star"),
    "texture": ("solid", "striped", "dotted", "checkered"),
    "position": ("top left", "top right", "bottom left", "bottom right"),
}
# Things the world varies and captions may say, but that get no attribute token: they are the
# "non-core concepts" that let a head's concept entropy spread (docs/METHOD.md Sec. 3).
EXTRA_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "size": ("small", "large"),
    "background": ("dark", "light"),
}
VALUES = {**ATTRIBUTES, **EXTRA_ATTRIBUTES}  # every attribute a scene has -> its values

# Base RGB of each colour word; the renderer jitters it per image.
COLOUR_RGB = {
    "red": (220, 40, 40), "orange": (245, 140, 25), "yellow": (235, 220, 40), "green": (40, 170, 60),
    "cyan": (40, 205, 215), "blue": (40, 70, 225), "purple": (140, 50, 195), "pink": (245, 125, 185),
}
assert set(COLOUR_RGB) == set(ATTRIBUTES["colour"]), "every colour word needs an RGB value"


# ---- 2. Scenes: the attribute values of one image ----------------------------------------
@dataclass(frozen=True)
class Scene:
    """One object on a background. Every field is a word from the tables above; the exact
    pixel position, size and colour are jittered by the renderer, not stored here."""

    colour: str
    shape: str
    texture: str
    position: str
    size: str = "large"
    background: str = "dark"

    def value(self, attribute: str) -> str:
        return getattr(self, attribute)


SCENE_FIELDS = tuple(f.name for f in fields(Scene))
assert SCENE_FIELDS == tuple(ATTRIBUTES) + tuple(EXTRA_ATTRIBUTES), "Scene fields follow the tables"


def sample_scene(rng: random.Random, **fixed: str) -> Scene:
    """A scene with every attribute drawn uniformly, except those given in `fixed`
    (e.g. sample_scene(rng, colour="red", shape="circle"))."""
    assert all(fixed[name] in VALUES.get(name, ()) for name in fixed), f"{fixed}: not attribute values"
    return Scene(**{name: fixed[name] if name in fixed else rng.choice(choices) for name, choices in VALUES.items()})


# ---- 3. The renderer ---------------------------------------------------------------------
# A whole batch (B images of S x S pixels) at once, on a grid of pixel centres in [0, 1]^2. A
# shape is an inside test in the object's coordinates (u, v) = (pixel - centre) / radius, so
# every shape fits in the unit disc and jittering the radius or centre comes for free.


@dataclass(frozen=True)
class Style:
    """How the world is drawn (not *what*). "pretrain" is the style the tiny CLIP learns from;
    "shifted" is the downstream task's (tinted, blotchy, noisier, outlined), so that zero-shot
    CLIP meets something it was not trained on and the task is not solved before training."""

    name: str
    noise: float  # std of the per-pixel Gaussian noise, in 0-255 units
    tint: float  # how far the background strays from grey towards a random colour (0-1)
    blotches: float  # amplitude of low-frequency background blotches (0-255 units)
    outline: bool  # draw a dark ring around the shape
    colour_jitter: float  # +- range added to each RGB channel of the object


STYLES = {
    "pretrain": Style("pretrain", noise=10.0, tint=0.0, blotches=0.0, outline=False, colour_jitter=18.0),
    "shifted": Style("shifted", noise=22.0, tint=0.35, blotches=35.0, outline=True, colour_jitter=30.0),
}


# The object's radius range per size word (a fraction of the image side), and how dark the
# texture's pattern is (a factor on the object's colour).
RADIUS = {"small": (0.15, 0.17), "large": (0.19, 0.23)}
PATTERN_SHADE = 0.5


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside test for one shape; u, v: (..., S, S) object coordinates (v grows downwards).
    Every shape reaches about radius 1, so all look about equally large."""
    au, av = np.abs(u), np.abs(v)
    if shape == "circle":
        return u**2 + v**2 <= 1.0
    if shape == "square":
        return np.maximum(au, av) <= 0.82
    if shape == "triangle":  # apex up at v = -1, base at v = 0.8
        return (v <= 0.8) & (au <= 0.55 * (v + 1.0))
    if shape == "diamond":
        return au + av <= 1.05
    if shape == "cross":  # a plus sign
        return ((au <= 0.33) & (av <= 1.0)) | ((av <= 0.33) & (au <= 1.0))
    if shape == "star":  # five points: the radius swings with the angle
        rho, theta = np.sqrt(u**2 + v**2), np.arctan2(v, u)
        return rho <= 0.6 + 0.45 * np.cos(5 * theta + np.pi / 2)
    raise ValueError(f"unknown shape {shape!r}; expected one of {ATTRIBUTES['shape']}")


def _texture_mask(texture: str, x: np.ndarray, y: np.ndarray, period: float, phase: np.ndarray) -> np.ndarray:
    """Where the pattern's dark colour goes; x, y: (1, S, S) pixel coordinates (in pixels),
    phase: (B, 1, 1) random offsets so the pattern does not sit still. Periods are in pixels,
    so a texture looks the same at any object size (a few stripes across an object)."""
    if texture == "solid":
        return np.zeros(np.broadcast_shapes(x.shape, phase.shape), dtype=bool)
    if texture == "striped":  # diagonal stripes, half dark
        return ((x + y) / period + phase) % 1.0 < 0.5
    if texture == "dotted":  # a dot at every grid point
        gx = (x / period + phase) % 1.0 - 0.5
        gy = (y / period + phase) % 1.0 - 0.5
        return gx**2 + gy**2 <= 0.3**2
    if texture == "checkered":  # cells half a period wide
        return ((np.floor(x / period * 2 + phase * 2) + np.floor(y / period * 2 + phase * 2)) % 2) == 1
    raise ValueError(f"unknown texture {texture!r}; expected one of {ATTRIBUTES['texture']}")


def render_batch(scenes: Sequence[Scene], rng: np.random.Generator, size: int = 32,
                 style: str = "pretrain") -> np.ndarray:
    """Draw many scenes at once -> (B, size, size, 3) uint8. `rng` supplies every jitter
    (exact centre, radius, colour, texture phase, noise), so the same generator state draws
    the same images."""
    look = STYLES[style]
    B, S = len(scenes), size
    coords = (np.arange(S) + 0.5) / S  # pixel centres in [0, 1]
    ys, xs = np.meshgrid(coords, coords, indexing="ij")  # (S, S) each

    # -- background: grey, dark or light, with optional tint and blotches ----------------
    grey = np.array([rng.uniform(45, 95) if s.background == "dark" else rng.uniform(150, 200)
                     for s in scenes])  # (B,)
    image = np.repeat(grey[:, None, None, None], 3, axis=3) * np.ones((1, S, S, 1))  # (B, S, S, 3)
    if look.tint:  # a colour cast per image
        image = image + rng.uniform(-1, 1, size=(B, 1, 1, 3)) * look.tint * 80
    if look.blotches:
        # Low-frequency blobs: a few random sinusoids, the same in all channels.
        fx, fy = rng.uniform(1, 3, size=(2, B, 1, 1))
        phase = rng.uniform(0, 2 * np.pi, size=(B, 1, 1))
        blobs = np.sin(2 * np.pi * (fx * xs + fy * ys) + phase) * look.blotches  # (B, S, S)
        image = image + blobs[..., None]

    # -- the object: where, how big, which colour --------------------------------------
    quadrant = {"top left": (0.25, 0.25), "top right": (0.75, 0.25),
                "bottom left": (0.25, 0.75), "bottom right": (0.75, 0.75)}
    radius = np.array([rng.uniform(*RADIUS[s.size]) for s in scenes])  # (B,) as a fraction of the image side
    slack = np.maximum(0.24 - radius, 0.0) * 0.8  # how far the centre may move inside its quadrant
    cx = np.array([quadrant[s.position][0] for s in scenes]) + rng.uniform(-1, 1, B) * slack
    cy = np.array([quadrant[s.position][1] for s in scenes]) + rng.uniform(-1, 1, B) * slack
    u = (xs[None] - cx[:, None, None]) / radius[:, None, None]  # (B, S, S) object coordinates
    v = (ys[None] - cy[:, None, None]) / radius[:, None, None]
    rgb = np.array([COLOUR_RGB[s.colour] for s in scenes], dtype=np.float64)  # (B, 3)
    rgb = rgb + rng.uniform(-1, 1, size=(B, 3)) * look.colour_jitter
    period = max(S / 8.0, 3.0)  # texture period in pixels: 4 at 32 px, never below 3
    texture_phase = rng.uniform(0, 1, size=(B, 1, 1))
    pixel_x, pixel_y = xs[None] * S, ys[None] * S  # (1, S, S) in pixels

    for i, scene in enumerate(scenes):
        inside = _shape_mask(scene.shape, u[i], v[i])  # (S, S)
        if look.outline:
            ring = _shape_mask(scene.shape, u[i] / 1.25, v[i] / 1.25) & ~inside
            image[i][ring] = 20.0
        pattern = _texture_mask(scene.texture, pixel_x, pixel_y, period, texture_phase[i:i + 1])[0]
        image[i][inside] = rgb[i]
        image[i][inside & pattern] = rgb[i] * PATTERN_SHADE  # the pattern: a dark version of the colour

    image = image + rng.normal(0, look.noise, size=image.shape)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def render(scene: Scene, seed: int, size: int = 32, style: str = "pretrain") -> np.ndarray:
    """One scene -> (size, size, 3) uint8, the same pixels for the same seed."""
    return render_batch([scene], np.random.default_rng(seed), size, style)[0]


# ---- 4. Captions -------------------------------------------------------------------------
# One word order: "<prefix> [size] [colour] [texture] <shape|object> [at the <position>]
# [on a <background> background]", naming a chosen subset of the attributes. The partial
# captions are the zero-shot prompts: "a photo of a red object" asks about colour only.

PREFIXES = ("a photo of a", "a picture of a", "a")
TEMPLATE = "a photo of a {}."  # the downstream task's prompt template (data.py's registry row)


def caption(scene: Scene, named: Optional[Iterable[str]] = None, prefix: str = "a photo of a",
            period: bool = False) -> str:
    """Describe `scene`, naming only the attributes in `named` (default: every attribute).

    >>> caption(Scene("red", "circle", "striped", "top left"), named=["colour"])
    'a photo of a red object'
    """
    named = set(SCENE_FIELDS if named is None else named)
    assert named <= set(SCENE_FIELDS), f"cannot name {sorted(named - set(SCENE_FIELDS))}; attributes are {SCENE_FIELDS}"
    words = [prefix] + [scene.value(name) for name in ("size", "colour", "texture") if name in named]
    words.append(scene.shape if "shape" in named else "object")
    if "position" in named:
        words.append(f"at the {scene.position}")
    if "background" in named:
        words.append(f"on a {scene.background} background")
    return " ".join(words) + ("." if period else "")


def random_naming(rng: random.Random) -> set[str]:
    """Which attributes a training caption names: a third of the time every core attribute,
    a third exactly one, a third a random non-empty subset; size and background each a third
    of the time on top. Why so many partial captions: an attribute is only *learned* where it
    tells the images of a batch apart; in a full caption colour and texture already do, while
    "a photo of a object at the top left" leaves position as the only thing to match on."""
    core = list(ATTRIBUTES)
    kind = rng.randrange(3)
    if kind == 0:
        named = set(core)
    elif kind == 1:
        named = {rng.choice(core)}
    else:
        named = {name for name in core if rng.random() < 0.5} or {rng.choice(core)}
    return named | {name for name in EXTRA_ATTRIBUTES if rng.random() < 1 / 3}


def random_caption(scene: Scene, rng: random.Random, named: Optional[set[str]] = None) -> str:
    """A training caption naming `named` (default: random_naming(rng)). The prefix and the
    final "." vary, so no single phrasing is the only one CLIP knows."""
    named = random_naming(rng) if named is None else named
    return caption(scene, named, prefix=rng.choice(PREFIXES), period=rng.random() < 0.5)


def describes(scene: Scene, named: Iterable[str], other: Scene) -> bool:
    """True if the caption of `scene` naming `named` is also true of `other` (it agrees on
    every named attribute). "a red object" describes every red scene."""
    return all(scene.value(name) == other.value(name) for name in named)


def attribute_prompts(attribute: str) -> list[str]:
    """Zero-shot prompts for one attribute, one per value, in the table's order:
    attribute_prompts("texture") -> ["a photo of a solid object", "a photo of a striped
    object", ...]. Built with `caption` so they are exactly the training phrasing."""
    template = Scene("red", "circle", "solid", "top left")
    return [caption(replace(template, **{attribute: value}), [attribute], "a photo of a") for value in VALUES[attribute]]


# ---- 5. The description bank (for the head analysis, docs/METHOD.md Sec. 3) --------------
# harness/bank.py's project_bank() speaks about real photos, in words that mean nothing to the toy CLIP.
# This bank is built from one concept's words and a few templates per phrase, so its concept is
# known by construction; size and background are non-core concepts, and "scene" phrases name
# several attributes at once, so a head that mixes everything has somewhere to spread.

_BANK_TEMPLATES = {
    "colour": ("a {} object", "something {}", "a photo of a {} object", "a picture of a {} object",
               "a {} thing"),
    "shape": ("a {}", "a photo of a {}", "a picture of a {}", "a {} shape", "a shape like a {}"),
    "texture": ("a {} object", "something {}", "a photo of a {} object", "a {} pattern", "a {} shape"),
    "position": ("an object at the {}", "a photo of an object at the {}", "something at the {}",
                 "a shape in the {}", "a picture with an object at the {}"),
    "size": ("a {} object", "something {}", "a photo of a {} object", "a {} shape", "a {} thing"),
    "background": ("an object on a {} background", "a {} background", "a photo with a {} background",
                   "a picture on a {} background", "something on a {} background"),
}


def toy_bank() -> list[tuple[str, str, str]]:
    """Phrases about the toy world, each labelled with its concept and the value it names
    (text, concept, value): every value of every attribute in each of its concept's
    templates, plus "scene" phrases that name two attributes at once. 142 phrases, no
    duplicates (the first concept to say a text keeps it)."""
    phrases = [(template.format(value), concept, value) for concept, templates in _BANK_TEMPLATES.items()
               for template in templates for value in VALUES[concept]]
    # Mixed phrases: colour + shape and texture + position, one of each pairing.
    phrases += [(f"a {colour} {shape}", "scene", f"{colour} {shape}")
                for colour, shape in zip(ATTRIBUTES["colour"], ATTRIBUTES["shape"] * 2)]
    phrases += [(f"a {texture} object at the {position}", "scene", f"{texture} {position}")
                for texture, position in zip(ATTRIBUTES["texture"], ATTRIBUTES["position"])]
    bank: dict[str, tuple[str, str, str]] = {}
    for entry in phrases:
        bank.setdefault(entry[0], entry)
    return list(bank.values())


# ---- 6. The corpus the BPE is learned from -----------------------------------------------
def corpus() -> list[str]:
    """Every word the toy CLIP will ever read, in context (all the BPE needs): one caption per
    (prefix, period, value, named alone or with all), the bank, the task's prompt template."""
    texts = []
    base = Scene("red", "circle", "solid", "top left", "small", "dark")
    for prefix in PREFIXES:
        for period in (False, True):
            for attribute, values in VALUES.items():
                for value in values:
                    scene = replace(base, **{attribute: value})
                    texts.append(caption(scene, [attribute], prefix, period))
                    texts.append(caption(scene, None, prefix, period))
    texts += [text for text, _, _ in toy_bank()]
    texts.append(TEMPLATE.format("red circle"))
    return texts


# ---- What a cache was drawn from ---------------------------------------------------------
# The caches (pretrain.py's toy CLIP, task.py's images) record this fingerprint and are rebuilt
# when it changes. It covers the tables above, not the drawing code: a change to how
# render_batch or caption work must bump WORLD_VERSION by hand.
WORLD_VERSION = 2  # 1: 32 px world, clock-stopped pretraining; 2: 48 px, larger objects, twins


def fingerprint() -> str:
    """A short hash of WORLD_VERSION and every table the renderer, captions and bank read."""
    tables = (WORLD_VERSION, ATTRIBUTES, EXTRA_ATTRIBUTES, COLOUR_RGB, sorted(STYLES.items()),
              RADIUS, PATTERN_SHADE, PREFIXES, TEMPLATE, _BANK_TEMPLATES)
    return hashlib.sha256(repr(tables).encode("utf-8")).hexdigest()[:16]


if __name__ == "__main__":
    generator = random.Random(0)
    for index in range(5):
        scene = sample_scene(generator)
        print(f"{scene}\n    {random_caption(scene, generator)}")
    print(f"bank: {len(toy_bank())} phrases; corpus: {len(corpus())} texts")
