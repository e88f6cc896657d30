"""harness/bank.py -- the head analysis' description pools as data: the project's labelled
bank (591 phrases over the 5 core attributes and 7 other concepts; --bank project, the default
on real data) and the reader of a pool file (one description per line; --bank PATH, TextSpan's
pool). dear.analyze_heads takes any list of dear.Description; sources.py chooses which. Imports
dear only for its Description record.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import dear
from .errors import TrainError


def read_descriptions(path: str, log: Callable[[str], None] = print) -> List[dear.Description]:
    """A pool file: one description per line, blank lines and '#' comments skipped, a repeated
    line kept once (with a count); 'text<TAB>concept' labels a line. Problems: one TrainError
    naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except FileNotFoundError:
        raise TrainError(f"{path}: no such description pool; "
                        "give a text file, one description per line") from None
    except UnicodeDecodeError:
        raise TrainError(f"{path}: not UTF-8 text; save the pool as UTF-8") from None
    except OSError as error:
        raise TrainError(f"{path}: cannot read the description pool "
                        f"({error.strerror or error})") from None
    entries = [dear.Description(*(part.strip() or None for part in line.split("\t", 1)))
               for line in lines if line and not line.startswith("#")]
    pool: Dict[str, dear.Description] = {}
    for entry in entries:
        if entry.text is not None:
            pool.setdefault(entry.text, entry)  # a repeated line: the first kept
    if not pool:
        raise TrainError(f"{path}: no descriptions in it (blank lines and '#' comments are skipped)")
    if len(pool) < len(entries):
        dropped = len(entries) - len(pool)
        log(f"{path}: {len(pool)} distinct descriptions ({dropped} repeated lines dropped)")
    return list(pool.values())


def project_bank() -> List[dear.Description]:
    """Each word of a concept in each of its templates (its concept known by construction): 591
    phrases, the 5 core attributes, then 7 concepts over which a head about none of them spreads
    (high entropy). No phrase twice (tests/test_dear.py checks)."""
    return [dear.Description(template.format(word), concept, word)
            for concept, (words, templates) in _BANK_WORDS.items()
            for template in templates for word in words]


_BANK_WORDS = {  # concept -> (words, templates): the five core attributes, then seven others
    "colour": (
        ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
         "grey", "gold", "silver", "beige", "turquoise", "maroon", "navy blue", "teal", "violet",
         "crimson"],
        ["a bright {} colour", "an image dominated by the colour {}", "something coloured {}",
         "a {} tint"]),
    "shape": (
        ["round", "square", "triangular", "rectangular", "oval", "cylindrical", "spherical",
         "star-shaped", "heart-shaped", "hexagonal", "curved", "pointed", "elongated", "flat",
         "cone-shaped", "spiral"],
        ["a {} shape", "an object with a {} form", "a {} outline", "something {} in shape"]),
    "texture": (
        ["striped", "dotted", "checkered", "furry", "smooth", "rough", "fluffy", "woven", "scaly",
         "wrinkled", "glossy", "matte", "grainy", "bumpy", "metallic", "wooden", "knitted",
         "cracked", "porous", "velvety"],
        ["a {} texture", "a {} surface", "a close-up of a {} pattern"]),
    "object": (
        ["bicycle", "car", "dog", "cat", "bird", "flower", "tree", "chair", "airplane", "boat",
         "house", "cup", "guitar", "clock", "horse", "fish", "shoe", "book", "phone", "lamp",
         "bottle", "apple", "pizza", "bridge", "train", "butterfly", "mushroom", "umbrella",
         "laptop", "piano"],
        ["a photo of a {}", "a picture of a {}", "a close-up of a {}"]),
    "location": (
        ["beach", "forest", "city street", "kitchen", "desert", "mountain top", "lake shore",
         "snowy field", "office", "garden", "classroom", "stadium", "farm", "coral reef",
         "highway", "river bank", "park", "living room", "harbour", "airport"],
        ["a photo taken at a {}", "a scene in a {}", "the background is a {}"]),
    "style": (
        ["watercolour painting", "pencil sketch", "oil painting", "cartoon", "3D render",
         "pixel art", "comic drawing", "mosaic", "embroidery", "origami model", "marble sculpture",
         "graffiti", "tattoo", "low-poly model", "woodcut print"],
        ["an image in the style of a {}", "a {} of something", "art made as a {}"]),
    "count": (
        ["one", "two", "three", "four", "five", "six", "seven", "a dozen", "many", "hundreds of"],
        ["{} objects in the picture", "an image with {} things in it", "a group of {} items"]),
    "lighting": (
        ["bright sunlight", "dim light", "backlight", "neon light", "candlelight", "harsh shadows",
         "soft light", "golden hour light", "flash", "overcast light", "studio lighting",
         "moonlight"],
        ["a photo taken with {}", "a scene lit by {}", "an image full of {}"]),
    "mood": (
        ["happy", "sad", "peaceful", "scary", "romantic", "energetic", "lonely", "nostalgic",
         "dramatic", "playful", "calm", "mysterious"],
        ["a {} mood", "a {} atmosphere", "a picture that feels {}"]),
    "text": (
        ["a sign with words", "a logo", "handwritten letters", "a newspaper page", "a street sign",
         "a label with numbers", "a caption", "a book title", "a licence plate", "a price tag"],
        ["an image containing {}", "a photo with {} in it", "a close-up of {}"]),
    "viewpoint": (
        ["an aerial view", "a close-up view", "a wide-angle view", "a side view",
         "a top-down view", "a low-angle view", "a fisheye view", "a macro view",
         "a panoramic view", "a rear view"],
        ["a photo taken from {}", "{} of a scene", "a picture shot as {}"]),
    "time": (
        ["morning", "noon", "evening", "night", "winter", "summer", "autumn", "spring", "sunset",
         "dawn"],
        ["a photo taken in the {}", "a scene at {}", "an image from the {}"]),
}
