"""How long train.py takes on an ImageNet-sized dataset before its first training step.

Builds ImageNet in CoOp's layout (classnames.txt, images/train/<wnid>/, images/val/<wnid>/)
and ImageNet-V2 (the cross-dataset target here) at shares of their sizes in a temporary
folder, one size at a time. Every image is a hard link to its class's one small JPEG: a
listing reads names, not pixels, so 128k images cost directory entries rather than gigabytes,
and no JPEG comes near ext4's 65,000 links. train.py then runs with the toy CLIP
(toyworld/assets/full/) and --method dear, each call in its own process, stopped where the
first run's training begins (train.train_job replaced by a stop):
  * --protocol cross, seeds 1 2 3 (16 shots): ImageNet's test set, V2's, three draws;
  * --protocol fewshot, 1/2/4/8/16 shots x seeds 1 2 3: the test set, fifteen draws.
Each call runs first (no few-shot cache: every draw made and written) and again (every draw
read from the cache, as --resume, --eval-only and later protocols read it), --repeats times;
the best of the repeats counts (the others waited for a busy machine). A --analyse-only call
first fills the head-analysis cache, so every timed call reuses it, as every call after a
model's first does; its own time is printed apart, since it reads --analysis-images (2,000)
images whatever the dataset's size.

Printed: each phase's seconds (model, settings and run folder; data: every test set and
few-shot draw, of which the dataset readers' listing; head roles: the analysis pool and its
fingerprint), the CPU seconds, the peak memory and the memory still held at the first step, at
each size measured and, on the least-squares line through them, at ImageNet's 1,281,167
training images (from one size: in proportion, an upper bound); how often each call listed
ImageNet.

    python benchmarks/bench_startup.py                       # 1% and 10% of ImageNet, minutes
    python benchmarks/bench_startup.py --fractions 0.01 --repeats 1      # about a minute
    python benchmarks/bench_startup.py --quick     # 0.1%, once, a 100-image analysis: its code runs

The folder (--folder, default the system's temporary folder) needs 4,000 inodes and about
6 MB per 100,000 images (directory entries; hard links take no inode): checked first, and
everything made there is removed at the end.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

IMAGENET_TRAIN, IMAGENET_VAL, IMAGENET_V2 = 1_281_167, 50_000, 10_000  # the real sizes
CLASSES = 1000
TOY = os.path.join(ROOT, "toyworld", "assets", "full")  # the shipped toy CLIP: 6 MB, loads in ms
ENTRY_BYTES = 64  # a directory entry of a name like n01440764_10026.JPEG, with room to spare
CALLS = {"cross, 3 seeds": ["--protocol", "cross", "--dataset", "imagenet_v2"],
         "fewshot, 15 draws": ["--protocol", "fewshot", "--dataset", "imagenet"]}


# ---- The dataset: hard links in a temporary folder ----------------------------------------

def per_class(total: int) -> list:
    """`total` images over the 1,000 classes, as evenly as integers allow (each at least 1)."""
    return [max(1, total // CLASSES + (label < total % CLASSES)) for label in range(CLASSES)]


def check_room(folder: str, images: int) -> None:
    """Enough free inodes (folders, one JPEG per class: a hard link takes none) and bytes
    (directory entries) in `folder`, or one line saying what is short."""
    stats = os.statvfs(folder)
    inodes = 4 * CLASSES + 100  # three folders and a JPEG per class, the caches, the run folders
    if stats.f_files and stats.f_favail < inodes:  # f_files 0: no inode limit (btrfs)
        sys.exit(f"bench_startup.py: error: {folder}: {stats.f_favail} free inodes, {inodes} "
                 "needed; choose another --folder")
    needed = images * ENTRY_BYTES + 3 * CLASSES * 4096 + 2**27  # + 128 MB: caches and run folders
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        sys.exit(f"bench_startup.py: error: {folder}: {free / 2**20:.0f} MB free, "
                 f"{needed / 2**20:.0f} MB needed; choose another --folder or smaller --fractions")


def link_images(jpeg: str, folder: str, names: list) -> None:
    os.makedirs(folder)
    for name in names:
        os.link(jpeg, os.path.join(folder, name))  # the same file system: made in the same folder


def make_imagenet(data_root: str, fraction: float) -> dict:
    """$DATA/imagenet and $DATA/imagenetv2 in CoOp's layout -> how many images of each."""
    from PIL import Image

    wnids = [f"n{10_000_000 + label:08d}" for label in range(CLASSES)]
    imagenet, v2 = os.path.join(data_root, "imagenet"), os.path.join(data_root, "imagenetv2")
    jpegs = os.path.join(data_root, "class_jpegs")  # the one file each class's images link to
    for folder in (imagenet, v2, jpegs):
        os.makedirs(folder)
    classnames = "".join(f"{wnid} class {label}\n" for label, wnid in enumerate(wnids))
    for folder in (imagenet, v2):
        with open(os.path.join(folder, "classnames.txt"), "w", encoding="utf-8") as f:
            f.write(classnames)
    counts = {part: per_class(round(total * fraction)) for part, total in
              (("train", IMAGENET_TRAIN), ("val", IMAGENET_VAL), ("v2", IMAGENET_V2))}
    val_index = 0  # ImageNet's validation images are numbered across the classes
    for label, wnid in enumerate(wnids):
        jpeg = os.path.join(jpegs, f"{wnid}.JPEG")
        Image.new("RGB", (64, 48), (label % 256, label // 4 % 256, 128)).save(jpeg)
        link_images(jpeg, os.path.join(imagenet, "images", "train", wnid),
                    [f"{wnid}_{i}.JPEG" for i in range(counts["train"][label])])
        names = [f"ILSVRC2012_val_{val_index + i:08d}.JPEG" for i in range(counts["val"][label])]
        link_images(jpeg, os.path.join(imagenet, "images", "val", wnid), names)
        val_index += len(names)
        link_images(jpeg, os.path.join(v2, "imagenetv2-matched-frequency-format-val", str(label)),
                    [f"{i}.jpeg" for i in range(counts["v2"][label])])
    return {part: sum(n) for part, n in counts.items()}


# ---- One train.py call, in a child process: the phases up to the first training step ------

class FirstStep(Exception):
    """Raised where the first run's training would begin: the start-up is over."""


def peak_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def resident_mb() -> float:
    """The memory held now (Linux; elsewhere 0): what stays with the run after its start-up."""
    if not os.path.isfile("/proc/self/statm"):
        return 0.0
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed_call(argv: list) -> dict:
    """train.run(argv) up to train.train_job -> each phase's wall and CPU seconds, how many
    times each dataset was read, the peak memory and the memory held at the stop (MB)."""
    import data
    from harness import analysis, cli
    import train

    seconds, cpu, readings, held = Counter(), Counter(), Counter(), []

    def timed(phase: str, function):
        def call(*args, **kwargs):
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - started
                cpu[phase] += time.process_time() - cpu_started
        return call

    def reader(function):
        def call(spec, dataset_dir):
            readings[spec.name] += 1
            return timed("listing", function)(spec, dataset_dir)
        return call

    def stop(*args, **kwargs):
        held.append(resident_mb())
        raise FirstStep

    for module, phase in ((train, "read_data"), (analysis, "analysed_role_maps")):  # train.py calls these
        setattr(module, phase, timed(phase, getattr(module, phase)))
    data.READERS.update({name: reader(function) for name, function in data.READERS.items()})
    train.train_job = stop
    args = cli.build_parser(train.BOOK).parse_args(argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        train.run(args)
    except FirstStep:
        pass
    else:
        if "--analyse-only" not in argv:  # which ends before any training, by design
            raise SystemExit("train.py ended before any training step")
    seconds["total"] = time.perf_counter() - started
    cpu["total"] = time.process_time() - cpu_started
    return dict(seconds=dict(seconds), cpu=dict(cpu), readings=dict(readings), peak_mb=peak_mb(),
                held_mb=held[0] if held else 0.0)


def run_call(argv: list, folder: str, show: bool) -> dict:
    """timed_call(argv) in a fresh process (its own peak memory), with what it printed if `show`."""
    result = os.path.join(folder, f"result-{time.monotonic_ns()}.json")
    child = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv), result],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if show:
        print("".join(f"    | {line}\n" for line in child.stdout.splitlines()), end="", flush=True)
    if child.returncode != 0:
        sys.exit(f"bench_startup.py: error: train.py {' '.join(argv)} failed:\n"
                 f"{child.stdout[-2000:]}{child.stderr[-3000:]}")
    with open(result, encoding="utf-8") as f:
        return json.load(f)


def measure(fraction: float, work: str, repeats: int, show: bool, flags: list) -> tuple:
    """ImageNet at `fraction` in `work`, the head analysis once, then each call first and
    again, `repeats` times -> (training images, {call: its repeats' results})."""
    started = time.perf_counter()
    data_root = os.path.join(work, "data")
    counts = make_imagenet(data_root, fraction)
    print(f"ImageNet at {100 * fraction:g}%: {counts['train']:,} training and {counts['val']:,} "
          f"test images in {CLASSES:,} classes, ImageNet-V2 {counts['v2']:,}; hard links made in "
          f"{time.perf_counter() - started:.1f} s in {work}", flush=True)
    os.environ["CLIP_CACHE_DIR"] = os.path.join(work, "cache")  # the head-analysis cache: ours
    common = ["--root", data_root, "--weights", os.path.join(TOY, "clip.pt"), "--bpe",
              os.path.join(TOY, "bpe.txt.gz"), "--head-width", "16", "--method", "dear",
              "--device", "cpu", *flags]

    def call(name: str, *flags: str) -> dict:  # in a new run folder
        output = os.path.join(work, "runs", f"{name.split(',')[0]}-{time.monotonic_ns()}")
        return run_call(common + CALLS[name] + list(flags) + ["--output", output], work, show)

    analysis = call("cross, 3 seeds", "--analyse-only")
    took = analysis["seconds"]["total"]
    print(f"  head analysis with the toy CLIP, once per model and pool ({took:.1f} s; it reads "
          "--analysis-images images whatever the dataset's size; the calls below reuse it)",
          flush=True)
    results = {f"{name}, {when}": [] for name in CALLS for when in ("first", "again")}
    for _ in range(repeats):
        for name in CALLS:
            for when in ("first", "again"):  # first: no few-shot cache yet; again: read from it
                if when == "first":
                    shutil.rmtree(os.path.join(data_root, "imagenet", "split_fewshot"), True)
                results[f"{name}, {when}"].append(call(name))
                took = results[f"{name}, {when}"][-1]["seconds"]["total"]
                print(f"  {name}, {when}: {took:.2f} s", flush=True)
    return counts["train"], results


# ---- The table: each phase at each size, and on a line through them at ImageNet's ---------

PHASES = [  # (row, where in a call's result); "fixed": what the dataset's size does not touch
    ("model, settings, run folder", ("fixed",)),
    ("data: the test sets and every draw", ("seconds", "read_data")),
    ("  of which the readers' listing", ("seconds", "listing")),
    ("head roles: the analysis pool, its fingerprint", ("seconds", "analysed_role_maps")),
    ("**to the first training step**", ("seconds", "total")),
    ("the same in CPU seconds (user + sys)", ("cpu", "total")),
    ("peak memory, MB", ("peak_mb",)),
    ("memory held at the first step, MB", ("held_mb",)),
]


def value(results: list, where: tuple) -> float:
    """The best (least) of a call's repeats at one phase."""
    if where == ("fixed",):  # the whole call but the phases that read the dataset
        return min(r["seconds"]["total"] - r["seconds"].get("read_data", 0)
                   - r["seconds"].get("analysed_role_maps", 0) for r in results)
    if len(where) == 1:
        return min(r[where[0]] for r in results)
    return min(r[where[0]].get(where[1], 0.0) for r in results)


def at_imagenet(points: list, where: tuple) -> str:
    """The value at 1,281,167 images on the least-squares line through the (images, value)
    points. From a single point: seconds in proportion (an upper bound), memory not at all (the
    runtime's share is unknown). A fixed cost: the mean."""
    mean_n, mean_y = (sum(point[i] for point in points) / len(points) for i in (0, 1))
    memory = where[0].endswith("_mb")
    if where == ("fixed",):
        return f"{mean_y:.1f}"
    if len(points) == 1:
        return "-" if memory else f"{mean_y * IMAGENET_TRAIN / mean_n:.1f}"
    slope = (sum((n - mean_n) * (y - mean_y) for n, y in points)
             / sum((n - mean_n) ** 2 for n, _ in points))
    return f"{mean_y + slope * (IMAGENET_TRAIN - mean_n):.{0 if memory else 1}f}"


def print_table(measured: dict) -> None:
    """measured: {training images: {call: its repeats' results}} -> a Markdown table whose
    cells hold the best at each size measured, then the value at ImageNet's size."""
    sizes = sorted(measured)
    calls = list(measured[sizes[0]])
    line = "on the line through them" if len(sizes) > 1 else "in proportion (an upper bound)"
    print(f"\nEach cell: at {' / '.join(f'{n:,}' for n in sizes)} training images (best of the "
          f"repeats) / at {IMAGENET_TRAIN:,}, {line}. Wall-clock seconds but where said.\n")
    print("| phase | " + " | ".join(calls) + " |")
    print("|---|" + "---:|" * len(calls))
    for row, where in PHASES:
        digits = 0 if where[0].endswith("_mb") else 2  # MB whole, seconds to 10 ms
        cells = []
        for call in calls:
            points = [(n, value(measured[n][call], where)) for n in sizes]
            measured_here = " / ".join(f"{y:.{digits}f}" for _, y in points)
            cells.append(f"{measured_here} / {at_imagenet(points, where)}")
        print(f"| {row} | " + " | ".join(cells) + " |")
    listed = [measured[sizes[-1]][call][0]["readings"].get("imagenet", 0) for call in calls]
    print("| ImageNet listed, times | " + " | ".join(map(str, listed)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description="train.py's start-up on an ImageNet-sized dataset")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1],
                        help="shares of ImageNet's 1,281,167 training images to build, one at a "
                             "time (default 0.01 0.1)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each call; the best counts (default 3)")
    parser.add_argument("--folder", default=tempfile.gettempdir(),
                        help="where the temporary dataset goes (default: the system's temporary "
                             "folder)")
    parser.add_argument("--show", action="store_true", help="print train.py's own lines too")
    parser.add_argument("--quick", action="store_true",
                        help="0.1%% of ImageNet, once, the analysis on 100 images (its code runs)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # a call: its argv, result file
    args = parser.parse_args()
    if args.child:
        result = timed_call(json.loads(args.child[0]))
        with open(args.child[1], "w", encoding="utf-8") as f:
            json.dump(result, f)
        return
    if args.quick:
        args.fractions, args.repeats = [0.001], 1
    if not all(0 < fraction <= 1 for fraction in args.fractions):
        parser.error(f"--fractions {' '.join(map(str, args.fractions))}: expected shares in (0, 1]")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected 1 or more")
    folder = os.path.abspath(args.folder)
    check_room(folder, round((IMAGENET_TRAIN + IMAGENET_VAL + IMAGENET_V2) * max(args.fractions)))
    measured = {}
    for fraction in sorted(set(args.fractions)):  # one tree at a time: the disk holds one
        work = tempfile.mkdtemp(prefix="bench_startup-", dir=folder)  # JPEGs, links: one disk
        try:
            quick = ["--analysis-images", "100"] * args.quick
            images, results = measure(fraction, work, args.repeats, args.show, quick)
            measured[images] = results
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print_table(measured)


if __name__ == "__main__":
    main()
