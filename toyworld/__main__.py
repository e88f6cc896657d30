"""
python -m toyworld -- prepare the toy world (or find it in the cache) and show what was made.

    python -m toyworld --scale miniature             # seconds: a tiny model, for a look
    python -m toyworld                               # full: the shipped model, seconds
    python -m toyworld --scale miniature --causal    # also run the head-ablation check
    python -m toyworld --grid samples.png            # a grid of images with their captions
    python -m toyworld --rebuild                     # pretrain the full model again (~11 minutes)
                                                     # and say whether it is the shipped one
"""

from __future__ import annotations

import os
import random
import sys
import textwrap
from typing import Optional

import torch

import clip_model
from harness import cli, files
import dear
import toyworld
from toyworld import world
from toyworld.causal import causal_check
from toyworld.pretrain import compare_with_shipped, draw_batch
from toyworld.task import zero_shot_on_task


def save_grid(path: str, image_size: int) -> None:
    """A 4 x 6 grid of freshly drawn images (pretraining style, then the task's shifted style),
    each with its full caption underneath, enlarged so the pixels are visible."""
    from PIL import Image, ImageDraw

    scene_rng, rows, columns = random.Random(0), 4, 6
    cell, text_height, zoom = 200, 40, 160 // image_size
    sheet = Image.new("RGB", (columns * cell, rows * (cell + text_height)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for index in range(rows * columns):
        style = "pretrain" if index < rows * columns // 2 else "shifted"
        scene = world.sample_scene(scene_rng)
        pixels = world.render(scene, seed=index, size=image_size, style=style)
        tile = Image.fromarray(pixels).resize((image_size * zoom,) * 2, Image.NEAREST)
        x, y = (index % columns) * cell, (index // columns) * (cell + text_height)
        sheet.paste(tile, (x + (cell - tile.width) // 2, y + 4))
        lines = textwrap.wrap(world.caption(scene, prefix="a") + f" [{style}]", width=30)
        for line_number, line in enumerate(lines):
            draw.text((x + 4, y + cell - 12 + 12 * line_number), line, fill=(0, 0, 0))
    sheet.save(path)


def path_problem(args) -> Optional[str]:
    """What is wrong with --cache-dir or --grid, in one line, or None: checked before the
    minutes of preparing the world, not after."""
    from PIL import Image

    if args.cache_dir is not None:
        if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
            return f"--cache-dir {args.cache_dir}: is a file, not a folder"
        if reason := files.unwritable_reason(args.cache_dir):
            return f"--cache-dir {args.cache_dir}: {reason}"
    if args.grid is not None:
        Image.init()
        folder = os.path.dirname(os.path.abspath(args.grid))
        if os.path.splitext(args.grid)[1].lower() not in Image.registered_extensions():
            return f"--grid {args.grid}: expected an image file name (e.g. samples.png)"
        if os.path.isdir(args.grid):
            return f"--grid {args.grid}: is a folder; give a file name (e.g. samples.png)"
        if not os.path.isdir(folder):
            return f"--grid {args.grid}: its folder does not exist (or is a file)"
        if reason := files.unwritable_reason(folder):
            return f"--grid {folder}: {reason}"
    return None


def main(argv=None) -> int:
    parser = cli.OneLineParser(prog="python -m toyworld", description="Prepare the toy world and show what was made.")
    parser.add_argument("--scale", default="full", choices=sorted(toyworld.SCALES), help="which size of world")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $CLIP_CACHE_DIR or ~/.cache/clip-from-scratch)")
    parser.add_argument("--grid", default=None, help="write a PNG grid of sample images with captions here")
    parser.add_argument("--causal", action="store_true", help="run the head analysis and the ablation check")
    parser.add_argument("--rebuild", action="store_true", help="pretrain the model afresh in the cache (full: "
                        "~11 minutes) instead of using the shipped one, and compare the two")
    args = parser.parse_args(argv)
    problem = path_problem(args)
    if problem is None:
        torch.set_num_threads(toyworld.THREADS)  # the toy world's one thread: the same tables everywhere
        try:
            assets = toyworld.prepare(args.scale, args.cache_dir, rebuild=args.rebuild)
        except (clip_model.CLIPFileError, OSError) as error:
            problem = str(error)
    if problem is not None:
        print(f"python -m toyworld: error: {problem}", file=sys.stderr)
        return 2
    print(f"\nweights     {assets.weights}  (clip_model.load(..., head_width={assets.head_width}))")
    print(f"bpe         {assets.bpe}")
    print(f"data_root   {assets.data_root}  (data.load_dataset('toyworld', data_root, ...))")
    print(f"attributes  {', '.join(assets.attributes)};  bank: {len(assets.bank)} phrases over "
          f"{len({dear.Description(*d).concept for d in assets.bank})} concepts")
    print(f"pretraining {assets.report}")
    if args.rebuild:
        print(f"rebuilt     {compare_with_shipped(assets.weights, assets.bpe, toyworld.SCALES[args.scale]['pretrain'])}")

    model, _ = clip_model.load(assets.weights, head_width=assets.head_width)
    tokenizer = clip_model.SimpleTokenizer(assets.bpe)
    for subsample in ("base", "novel"):
        accuracy = zero_shot_on_task(model, tokenizer, assets.data_root, subsample)
        print(f"task zero-shot accuracy, {subsample} classes (test): {accuracy:.1%}")

    if args.grid:
        save_grid(args.grid, assets.image_size)
        print(f"wrote {args.grid}")
    if args.causal:
        images, _ = draw_batch(7, 256, assets.image_size)
        roles = dear.analyze_heads(model, [images], tokenizer, assets.bank, assets.attributes, log=lambda line: None,
                                   num_layers=min(2, len(model.visual.transformer.resblocks)), num_descriptions=10)
        print(roles.table())
        print(causal_check(model, tokenizer, roles)["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
