"""harness/pictures.py -- the PNG pictures a run folder holds: the head roles (roles.png), the
role masks (masks.png), a run's training curves (curves.png) and its retrieval
(retrieval_<feature>.png). Pillow is torchvision's own dependency.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import torch

import clip_model
import data
import dear


# One hue per attribute, grey-blue for generalization, light grey for mixed. Pillow is
# torchvision's own dependency.
ATTRIBUTE_COLOURS = [(214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
                     (227, 119, 194), (188, 189, 34), (140, 86, 75)]


GENERALIZATION_COLOUR, MIXED_COLOUR = (52, 78, 120), (200, 200, 200)


def draw_heatmap(role_map: dear.RoleMap, path: str) -> None:
    """layers (rows, 1-based) x heads (columns); each cell coloured by role, with the head's
    concept entropy written in it, and a legend."""
    from PIL import Image, ImageDraw

    # pixels
    cell_w, cell_h, left, top, layers, H = 58, 34, 96, 52, role_map.layers, role_map.num_heads
    legend = {f"attribute: {a}": ATTRIBUTE_COLOURS[i % len(ATTRIBUTE_COLOURS)] for i, a in
              enumerate(role_map.attributes)} | {"generalization": GENERALIZATION_COLOUR,
                                                 "mixed": MIXED_COLOUR}
    # the legend: three per line
    height = top + len(layers) * cell_h + 30 + 18 * ((len(legend) + 2) // 3)
    # 560: the title's width
    image = Image.new("RGB", (max(left + H * cell_w + 10, 560), height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, 4), f"DeAR head roles; number = concept entropy (bits)\n{role_map.source}",
              fill="black")
    for head in range(H):
        draw.text((left + head * cell_w + cell_w // 2 - 8, top - 16), f"h{head}", fill="black")
    for row, layer in enumerate(layers):
        y = top + row * cell_h
        draw.text((8, y + cell_h // 2 - 6), f"layer {layer + 1}", fill="black")
        for head in range(H):
            entry = role_map.role_of(layer, head)
            colour = legend[f"attribute: {entry.attribute}" if entry.role == "attribute"
                            else entry.role]
            x = left + head * cell_w
            draw.rectangle([x, y, x + cell_w - 2, y + cell_h - 2], fill=colour)
            label = "" if entry.entropy is None else f"{entry.entropy:.2f}"
            # which cluster named it
            if entry.role == "attribute" and role_map.concepts == "clusters":
                # e.g. "cl. 3"
                label += "\ncl. " + dear.dominant_concept(entry.concepts).split()[-1]
            draw.text((x + 6, y + cell_h // 2 - 6 * label.count("\n") - 6), label,
                      fill="black" if sum(colour) > 450 else "white")
    y = top + len(layers) * cell_h + 12
    for i, (name, colour) in enumerate(legend.items()):
        x, yy = 8 + (i % 3) * 180, y + (i // 3) * 18
        draw.rectangle([x, yy, x + 12, yy + 12], fill=colour)
        draw.text((x + 18, yy), name, fill="black")
    clip_model.atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def draw_role_masks(masks: torch.Tensor, num_image_tokens: int, attributes: List[str],
                    first_layer: int, path: str, role_map: Optional[dear.RoleMap] = None) -> None:
    """masks.png: the masks (L, H, T, T) folded to the image and the attribute tokens, one small
    grid per head (row = query token, column = key token), one row of grids per layer (1-based),
    each grid's head and role above it. White = may attend, black = may not."""
    from PIL import Image, ImageDraw

    layers, H, A = masks.shape[0], masks.shape[1], len(attributes)
    kept = [0, *range(num_image_tokens, masks.shape[-1])]  # the image tokens folded into one
    names = ["I"] + [a[0] for a in attributes]  # the tokens' initials, in mask order
    cell, left, top, gap = 12, 84, 96, 22  # pixels
    grid = (1 + A) * cell
    width = max(left + H * (grid + gap), 640)
    image = Image.new("RGB", (width, top + layers * (grid + gap + 12) + 10), "white")
    draw = ImageDraw.Draw(image)
    lines = ["DeAR role masks: one grid per head, one row of grids per layer (1-based)",
             "row = query token, column = key token; white = may attend, black = may not",
             "tokens: I = the image's (the class token and the patches, alike), then "
             + ", ".join(f"{a[0]} = {a}" for a in attributes),
             "above each grid: the head and its role (A:col = attribute head for colour, "
             "G = generalization, M = mixed)"]
    for row, text in enumerate(lines):
        draw.text((6, 6 + 14 * row), text, fill="black")
    for li in range(layers):
        y0 = top + li * (grid + gap + 12)
        draw.text((6, y0 + grid // 2 - 6), f"layer {first_layer + li}", fill="black")
        for head in range(H):
            x0 = left + head * (grid + gap)
            entry = role_map.role_of(first_layer - 1 + li, head) if role_map else None
            tag = ("M" if entry is None else {"attribute": f"A:{(entry.attribute or '')[:3]}",
                                              "generalization": "G", "mixed": "M"}[entry.role])
            draw.text((x0, y0 - 12), f"h{head} {tag}" if role_map else f"h{head}", fill="black")
            folded = masks[li, head][kept][:, kept]  # (1 + A, 1 + A)
            for r in range(1 + A):
                for c in range(1 + A):
                    draw.rectangle([x0 + c * cell, y0 + r * cell, x0 + (c + 1) * cell - 1,
                                    y0 + (r + 1) * cell - 1],
                                   fill="white" if folded[r, c] == 0 else "black",
                                   outline=(150, 150, 150))
            if head == 0:  # the tokens' initials: query rows at the left, key columns below
                for index, name in enumerate(names):
                    draw.text((x0 - 10, y0 + index * cell), name, fill=(90, 90, 90))
                    draw.text((x0 + index * cell + 3, y0 + grid + 1), name, fill=(90, 90, 90))
    clip_model.atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def draw_curves(records: List[dict], title: str, epochs: int, path: str) -> None:
    """curves.png from a run's metrics.jsonl, one point per epoch: the loss terms (left), the
    training accuracy and the class branch's fusion weight alpha_cls, both in % (right). No
    record (no epoch trained): no picture."""
    from PIL import Image, ImageDraw

    if not records:
        return
    width, height, plot_w, plot_h, top = 960, 430, 360, 290, 44  # pixels
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), f"{title}: training curves, one point per epoch (metrics.jsonl)",
              fill="black")
    x = [record["epoch"] for record in records]
    terms = dict.fromkeys(key for record in records for key in record["loss"])  # in their order
    losses = {key: [record["loss"].get(key) for record in records] for key in terms}
    shares = {"training accuracy": [record["train_accuracy"] for record in records],
              "alpha of the class branch": [100 * record["alpha"]["class"] for record in records]}
    for panel, (name, series, low, high) in enumerate(
            [("loss (mean over the epoch's images)", losses, 0.0, None), ("%", shares, 0, 100)]):
        left = 70 + panel * 480
        values = [v for ys in series.values() for v in ys if v is not None]
        ticks = round_ticks(high or max(max(values, default=1.0), 1e-6))  # the y axis
        high = ticks[-1]

        def point(epoch: float, value: float) -> tuple:
            return (left + (epoch - 1) / max(epochs - 1, 1) * plot_w,
                    top + plot_h - (value - low) / (high - low) * plot_h)

        draw.rectangle([left, top, left + plot_w, top + plot_h], outline="black")
        for value in ticks:
            y = point(1, value)[1]
            draw.line([left - 4, y, left, y], fill="black")
            draw.text((left - 46, y - 6), f"{value:g}", fill="black")
        for epoch in sorted({1, epochs, *range(5, epochs, 5)}):  # the x axis
            tick_x = point(epoch, low)[0]
            draw.line([tick_x, top + plot_h, tick_x, top + plot_h + 4], fill="black")
            draw.text((tick_x - 6, top + plot_h + 6), str(epoch), fill="black")
        draw.text((left + plot_w // 2 - 16, top + plot_h + 20), "epoch", fill="black")
        draw.text((left, top - 16), name, fill="black")
        for index, (label, ys) in enumerate(series.items()):
            colour = ATTRIBUTE_COLOURS[index % len(ATTRIBUTE_COLOURS)]
            points = [point(e, v) for e, v in zip(x, ys) if v is not None]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            for px, py in points:
                draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
            legend_y = top + plot_h + 40 + 16 * (index // 3)
            legend_x = left + 125 * (index % 3)
            draw.rectangle([legend_x, legend_y + 2, legend_x + 10, legend_y + 12], fill=colour)
            draw.text((legend_x + 16, legend_y), label, fill="black")
    clip_model.atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def fitted(draw, text: str, width: int) -> List[str]:
    """`text` in lines no wider than `width` pixels, broken between words (a word too long for
    one line is cut)."""
    lines: List[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            while len(word) > 1 and draw.textlength(word) > width:
                word = word[:-1]
            lines.append(word)
    return lines


def round_ticks(high: float, count: int = 4) -> List[float]:
    """0 to at least `high` in steps of a round size (1, 2, 2.5 or 5 x 10^n), at most `count`:
    0, 0.5, 1, 1.5 rather than 0, 0.399, 0.798, 1.2."""
    unit = 10 ** math.floor(math.log10(high / count))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit * count >= high)
    return [round(step * i, 10) for i in range(math.ceil(high / step - 1e-9) + 1)]


def draw_retrieval(gallery: list, rankings: Dict[str, torch.Tensor], size: int, queries: int,
                   shown: int, folder: str, label: str) -> None:
    """retrieval_<feature>.png in `folder`, one per feature that ranks the gallery: a title
    naming the feature, then per row a query test image (framed in red) and its `shown` nearest
    gallery images by that feature's cosine, nearest first (rankings: {feature: (M, k)})."""
    from PIL import Image, ImageDraw

    tile = max(size, 64)  # pixels: small images enlarged (nearest neighbour)
    import torchvision  # the test transform's resize and centre crop, on a PIL image

    pictures = data.ImageDataset(gallery, torchvision.transforms.Compose(
        data.test_transform(size).transforms[:2]))
    for name, ranking in rankings.items():
        feature = {"class": "the class feature", "frozen CLIP": "frozen CLIP's image feature"}.get(
            name, f"the {name} token's feature")
        rows, found = min(queries, len(gallery)), min(shown, ranking.shape[1])  # a small gallery
        image = Image.new("RGB", (12 + (1 + found) * (tile + 4) + 8, 56 + rows * (tile + 30)),
                          "white")
        draw = ImageDraw.Draw(image)
        draw.text((8, 6), f"{label}: retrieval by {feature}", fill="black")
        draw.text((8, 22), f"each row: a test image (red frame), then its {found} nearest test "
                  f"images by cosine, nearest first; under each, its class", fill="black")
        for row in range(rows):
            for column, index in enumerate([row] + ranking[row, :found].tolist()):
                x, y = 12 + column * (tile + 4), 44 + row * (tile + 30)
                picture = pictures[index][0].resize((tile, tile), Image.NEAREST)
                image.paste(picture, (x, y))
                for line, words in enumerate(fitted(draw, gallery[index].classname, tile)[:2]):
                    draw.text((x, y + tile + 1 + 12 * line), words, fill="black")
                if column == 0:
                    draw.rectangle([x - 2, y - 2, x + tile + 1, y + tile + 1], outline=(220, 30, 30),
                                   width=2)
        clip_model.atomic_write(os.path.join(folder, f"retrieval_{name.replace(' ', '_')}.png"),
                                lambda tmp: image.save(tmp, format="PNG"))
