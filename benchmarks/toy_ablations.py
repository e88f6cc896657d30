"""
benchmarks/toy_ablations.py -- the paper's ablation study on the toy world, and why its attribute
tokens do not carry their attribute, measured: docs/TOYWORLD.md's tables, in one command.

    python benchmarks/toy_ablations.py     # docs/TOYWORLD.md's tables: 3 seeds
    python benchmarks/toy_ablations.py --toy-scale miniature --seeds 1 --epochs 1 --output /tmp/abl

Every run is `train.py --dataset toyworld` (train.main, in this process), in a folder of its own
under --output:
  ablations/    the quick start's rows, the paper's ablations and the lab's controls beside them
                (--ablations all), the controls in a table of their own (lab_table)
  <candidate>/  the DeAR row with one training setting changed: a candidate cause of the tokens'
                weak retrieval (beta, lambda_fusion, the epochs, the token construction that is not
                the default: --tokens shared, MMRL++'s). The per-branch cross-entropy and
                lambda_fusion = 0 are rows of ablations/ (branch-ce, no-fusion-reg).
A finished folder is read again and a stopped one continued (train.py --resume), so a second call
only prints the tables again. Every row follows the role map, which a run folder keeps: after a
change to the head analysis (or any code), measure again into an empty --output. The tables are
printed and written to <output>/tables.md.
"""

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dear  # noqa: E402
from harness import devices, files, reports  # noqa: E402
import train  # noqa: E402

RECIPE = train.RECIPES["base2novel"]["toyworld"]  # the toy's beta, lambda_fusion, epochs: one place
ATTRIBUTES = ["colour", "shape", "texture", "position"]  # the toy world's tokens, in token order

# Table row -> (its name on the command line, what the paper's "Ablation Study" reports for it, as
# a public note of the paper sums it up: no numbers of it are public to us).
PAPER = {"dear-fused": ("DeAR (no ablation)", "the full method"),
         "dear-all-mixed": ("no-role-mask", "a significant drop on novel classes"),
         "dear-no-attribute-tokens": ("no-attribute-tokens", "a drop on base and on novel"),
         "dear-no-fusion-reg": ("no-fusion-reg", "over-reliance on the attribute features"),
         "dear-mask-generalization-only": ("mask-generalization-only",
                                           "protects generalization already"),
         "dear-all-generalization": ("--roles all-generalization", "not in the paper (ours)"),
         "dear-branch-ce": ("branch-ce", "not the paper's loss (MMRL's)")}


def candidates(epochs: int) -> list:
    """(folder, label, flags): the DeAR row with one training setting of the toy recipe changed."""
    other = next(t for t in dear.TOKEN_CONSTRUCTIONS if t != train.DEFAULTS["tokens"])
    return [("beta-0.9", "beta 0.9", ["--beta", "0.9"]),
            ("beta-0.1", "beta 0.1", ["--beta", "0.1"]),
            ("lambda-fusion-1", "lambda_fusion 1.0", ["--lambda-fusion", "1.0"]),
            (f"epochs-{3 * epochs}", f"{3 * epochs} epochs", ["--epochs", str(3 * epochs)]),
            (f"tokens-{other}", f"tokens {other} (--tokens {other})", ["--tokens", other])]


def run(folder: str, flags: list) -> dict:
    """train.py --dataset toyworld FLAGS in `folder` (continued if begun) -> its summary.json and
    retrieval.json."""
    begun = os.path.isfile(os.path.join(folder, "settings.json"))
    argv = ["--output", folder, "--resume"]
    if not begun:
        argv = ["--dataset", "toyworld", "--output", folder, *flags]
    if train.main(argv) != 0:
        raise SystemExit(f"toy_ablations.py: python train.py {' '.join(argv)} failed (above); fix "
                         "it, then run this again: finished runs are kept")
    found = {}
    for name in ("summary", "retrieval"):
        with open(os.path.join(folder, f"{name}.json"), encoding="utf-8") as f:
            found[name] = json.load(f)
    return found


# ---- the tables -----------------------------------------------------------------------------
def cell(mean: float, sd: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def job_row(row: str) -> str:
    return "dear" if row == "dear-fused" else row  # the DeAR row's table key names its fusion rule


def accuracy_cells(summary: dict, row: str) -> list:
    table = summary["tables"]["toyworld"]
    return [cell(v, d) for v, d in zip(table["rows"][row], table["spread"][row])]


def alpha_cell(summary: dict, row: str) -> str:
    return cell(*summary["alpha"]["toyworld"][job_row(row)]["class"])


def retrieval_cells(retrieval: dict, row: str) -> list:
    """Precision@10 of each token on its own attribute, then the class feature's: colour, shape."""
    table = retrieval[job_row(row)]

    def shown(value) -> str:
        return "blind" if value == "blind" else cell(*value, digits=1)

    own = [shown(table[a][a]) if a in table else "-" for a in ATTRIBUTES]
    return own + [shown(table["class"]["colour"]), shown(table["class"]["shape"])]


def ablation_table(summary: dict, seeds: str) -> list:
    columns = ["Base", "Novel", "HM", "alpha_cls", "the paper reports"]
    rows = {PAPER[row][0]: accuracy_cells(summary, row) + [alpha_cell(summary, row), PAPER[row][1]]
            for row in PAPER if row in summary["tables"]["toyworld"]["rows"]}
    lines = reports.md_table("Row (--ablations)", columns, rows)
    lines[1] = lines[1][:-len("---:|")] + "---|"  # the words left-aligned
    title = f"## The paper's ablations on the toy world ({seeds}; fused logits on every test set)"
    return [title, "", *lines, ""]


# The lab's question (docs/TOYWORLD.md): which heads the tokens may reach, how the branches are
# fused, one loss term; each row under both scoring rules (harness.cli.FUSION_MODES).
LAB = {"dear": "concept entropy (the analysed map)", "dear-shuffled-heads": "shuffled heads",
       "dear-whole-layers": "whole top layers, as open", "dear-true-heads": "the true heads",
       "dear-all-mixed": "all heads mixed", "dear-all-generalization": "all heads generalization",
       "dear-fixed-fusion": "fusion fixed (0.7 class)", "dear-feature-fusion": "features fused",
       "dear-no-self-reg": "no self-regularisation"}


def lab_table(folder: str, seeds: str) -> list:
    """The controls from each run's results.json (every run is scored under both rules), as the
    summary's table: HM of the mean base and novel, its spread that of the seeds' own HMs."""
    modes, rows = [], {}
    for row, label in LAB.items():
        paths = sorted(glob.glob(os.path.join(folder, "toyworld", row, "seed*", "results.json")))
        runs = [json.load(open(path, encoding="utf-8"))["metrics_by_fusion"] for path in paths]
        modes = list(runs[0]) if runs else modes
        cells = []
        for mode in modes if runs else []:
            base, novel = ([run[mode][key] for run in runs] for key in ("base", "novel"))
            hm = reports.harmonic_mean(reports.mean(base), reports.mean(novel))
            seeds_hm = [run[mode]["hm"] for run in runs]
            cells += [cell(reports.mean(values), reports.spread(values)) for values in (base, novel)]
            cells.append(cell(hm, reports.spread(seeds_hm)))
        if cells:
            rows[label] = cells[:3] + cells[4:]  # base is fused under either rule: shown once
    columns = ["Base"] + [f"{key} ({mode})" for mode in modes for key in ("Novel", "HM")]
    return [f"## The paper's question: which heads, which fusion ({seeds})", "",
            *reports.md_table("DeAR with", columns, rows), ""]


def diagnosis_table(ablations: dict, measured: list, seeds: str, epochs: int) -> list:
    recipe = (f"toy recipe (beta {RECIPE.beta:g}, lambda_fusion {RECIPE.lambda_fusion:g}, "
              f"{epochs} epochs, CE on the fused logits)")
    runs_of = {recipe: ("dear-fused", ablations),  # label -> (table row, its run folder's files)
               "+ CE per branch (branch-ce, not the paper's loss)": ("dear-branch-ce", ablations),
               "lambda_fusion 0 (no-fusion-reg)": ("dear-no-fusion-reg", ablations),
               "all heads mixed (no-role-mask)": ("dear-all-mixed", ablations),
               "attribute heads mixed (mask-generalization-only)":
                   ("dear-mask-generalization-only", ablations),
               **{label: ("dear-fused", result) for label, result in measured}}
    rows = {label: retrieval_cells(result["retrieval"], row) + [alpha_cell(result["summary"], row)]
            + accuracy_cells(result["summary"], row) for label, (row, result) in runs_of.items()}
    columns = [f"{a} token: {a}" for a in ATTRIBUTES]
    columns += ["class: colour", "class: shape", "alpha_cls", "Base", "Novel", "HM"]
    frozen = ablations["retrieval"]["dear"]["frozen CLIP"]
    return [f"## Why the tokens do not carry their attribute: precision@10 (%) per candidate "
            f"({seeds})", "",
            "Each token ranked on its own attribute (chance: colour 25, shape 17, texture 25, "
            f"position 25); frozen CLIP: colour {frozen['colour'][0]:.1f}, "
            f"shape {frozen['shape'][0]:.1f}; alpha_cls = the class branch's learned weight; "
            "Base, Novel, HM with the fused logits.", "",
            *reports.md_table("DeAR trained with", columns, rows), ""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--output", default=os.path.join("runs", "toy-ablations"), help="the runs")
    p.add_argument("--seeds", nargs="+", default=["1", "2", "3"], help="seeds of every run")
    p.add_argument("--epochs", type=int, help=f"the toy recipe's epochs (unset: {RECIPE.epochs})")
    p.add_argument("--toy-scale", choices=("full", "miniature"), default="full", help="toy world")
    args = p.parse_args(argv)
    started, epochs = time.time(), args.epochs or RECIPE.epochs
    common = ["--seeds", *args.seeds, "--toy-scale", args.toy_scale]
    recipe = ["--epochs", str(args.epochs)] if args.epochs else []
    ablations = run(os.path.join(args.output, "ablations"),
                    [*common, *recipe, "--ablations", "all"])
    measured = []
    for folder, label, flags in candidates(epochs):
        own = flags if "--epochs" in flags else [*recipe, *flags]  # its own epochs, or the recipe's
        dear_row = [*common, "--method", "dear", "--roles", "analyse", *own]
        measured.append((label, run(os.path.join(args.output, folder), dear_row)))
    seeds = f"seeds {' '.join(args.seeds)}, mean ± sd"
    text = "\n".join(ablation_table(ablations["summary"], seeds)
                     + lab_table(os.path.join(args.output, "ablations"), seeds)
                     + diagnosis_table(ablations, measured, seeds, epochs))
    files.write_text(os.path.join(args.output, "tables.md"), text)
    print(f"\n{text}\ntoy_ablations.py: done in {devices.format_time(time.time() - started)}; "
          f"tables in {os.path.join(args.output, 'tables.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
