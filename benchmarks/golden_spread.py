"""How far the golden record's numbers move from one machine to another, and over seeds: the
measurement behind tests/test_golden.py's TOLERANCE.

    python benchmarks/golden_spread.py              # about 10 minutes on 2 cores
    python benchmarks/golden_spread.py --quick      # the miniature toy, one variant: its code runs

It runs the golden record's first run (tests/test_golden.py RUNS["ablations"]: zero-shot and
every ablation row, 2 epochs on 2 shots of the full toy world) in fresh processes, each time
changing one thing that changes the last bits of a float sum on another machine:
  * the toy world's thread count, 1 (its own), 2 and 3: another split of every reduction;
  * the CPU kernels torch uses, `ATEN_CPU_CAPABILITY` = default (no vector kernels), avx2 and
    this machine's own: another CPU kind's arithmetic;
and, for scale, the same run at seeds 2 and 3 (what a real change of the training moves). It
prints, per kind of number, the largest difference from the record made here first (the
toy's one thread, this machine's kernels, seed 1), and whether roles.json and the zero-shot
row stayed the same.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--dataset", "toyworld", "--seeds", "1", "--epochs", "2", "--shots", "2",
       "--method", "zeroshot", "dear", "--ablations", "all"]
# Run train.main in a fresh process with the toy world's thread count replaced.
SCRIPT = ("import sys; sys.path.insert(0, {repo!r}); import toyworld; toyworld.THREADS = {threads}; "
          "import train; sys.exit(train.main({argv!r}))")


def run(folder: str, cache: str, threads: int = 1, capability: str = None, seed: int = 1,
        extra: tuple = ()) -> dict:
    """One golden run -> {"results": {run folder: results.json}, "roles": roles.json's text}."""
    argv = [a if a != "1" or RUN[i - 1] != "--seeds" else str(seed) for i, a in enumerate(RUN)]
    argv += ["--output", folder, *extra]
    env = dict(os.environ, DEAR_CACHE_DIR=cache)
    env.pop("CLIP_CACHE_DIR", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    code = SCRIPT.format(repo=REPO, threads=threads, argv=argv)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    results = {}
    for parent, _, files in sorted(os.walk(os.path.join(folder, "toyworld"))):
        if "results.json" in files:
            with open(os.path.join(parent, "results.json"), encoding="utf-8") as f:
                results[os.path.relpath(parent, folder).replace(f"seed{seed}", "seed")] = json.load(f)
    with open(os.path.join(folder, "toyworld", "roles", "roles.json"), encoding="utf-8") as f:
        return dict(results=results, roles=f.read())


def largest_moves(found: dict, reference: dict) -> dict:
    """{kind of number: the largest absolute difference}, kind = accuracy (points), alpha,
    retrieval (a share); zero-shot's accuracies apart."""
    moves = dict.fromkeys(("accuracy", "alpha", "retrieval", "zero-shot accuracy"), 0.0)

    def walk(a, b, kind):
        if isinstance(b, dict):
            for key in b:
                walk(a[key], b[key], kind)
        elif isinstance(b, float):
            moves[kind] = max(moves[kind], abs(a - b))

    for folder, results in reference.items():
        for key, kind in (("accuracy_by_logits", "accuracy"), ("alpha", "alpha"),
                          ("retrieval", "retrieval")):
            if results.get(key):
                kind = "zero-shot accuracy" if "zeroshot" in folder else kind
                walk(found[folder][key], results[key], kind)
    return moves


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the miniature toy world, one variant")
    quick = parser.parse_args(argv).quick
    import torch

    own = torch.backends.cpu.get_cpu_capability().lower()
    variants = [("threads 2", dict(threads=2)), ("threads 3", dict(threads=3)),
                ("kernels: default", dict(capability="default")),
                ("kernels: avx2", dict(capability="avx2")),
                ("seed 2", dict(seed=2)), ("seed 3", dict(seed=3))][:1 if quick else None]
    extra = ("--toy-scale", "miniature") if quick else ()
    with tempfile.TemporaryDirectory() as scratch:
        cache = os.path.join(scratch, "cache")
        reference = run(os.path.join(scratch, "reference"), cache, extra=extra)
        print(f"reference: threads 1, kernels {own}, seed 1 (torch {torch.__version__})")
        print(f"{'variant':<18}{'accuracy':>10}{'alpha':>8}{'retrieval':>11}{'zero-shot':>11}"
              f"  roles.json")
        for index, (name, change) in enumerate(variants):
            found = run(os.path.join(scratch, f"variant{index}"), cache, **change, extra=extra)
            moves = largest_moves(found["results"], reference["results"])
            same = "same" if found["roles"] == reference["roles"] else "DIFFERENT"
            print(f"{name:<18}{moves['accuracy']:>10.2f}{moves['alpha']:>8.4f}"
                  f"{moves['retrieval']:>11.4f}{moves['zero-shot accuracy']:>11.2f}  {same}",
                  flush=True)
    print("accuracy and zero-shot in points; alpha a fusion weight; retrieval a precision@10 share")
    return 0


if __name__ == "__main__":
    sys.exit(main())
