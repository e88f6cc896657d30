"""harness/plan.py -- a call as a list of runs (Job: a table row x dataset x seed x shots, each
with its folder), the table rows and their labels, and what decides a run's result
(job_settings). Called by train.run, reports.py and runfolder.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from .cli import ROLE_ABLATIONS, ROLE_ROWS, ablation_roles
from .config import RUN_CONTROL


@dataclass
class Job:
    dataset: str  # the dataset trained on (the source, for cross and dg)
    # "zeroshot", "linear-probe", "dear", "dear-<roles>" (a --roles map: dear-all-mixed, ...),
    # "dear-<ablation>" (dear-no-fusion-reg, ...): plan.row_name
    row: str
    # DeAR's map: "analyse", "all-mixed", "all-generalization" or a roles file (None: no DeAR)
    roles: Optional[str]
    seed: Optional[int]  # None for zero-shot: it has no randomness, one run serves every seed
    shots: Optional[int]  # None for zero-shot (it does not train)
    folder: str  # <output>/<dataset>/<row>/<seed leaf>: checkpoint.pt, results.json, results.md
    ablation: Optional[str] = None  # one of dear.ABLATIONS: its one change, by dear.ablate

    @property
    def label(self) -> str:
        """e.g. "oxford_pets / dear / seed 1"; the shots too where they vary (fewshot)."""
        parts = [self.dataset, self.row] + ([f"seed {self.seed}"] if self.seed is not None else [])
        varies = os.path.basename(self.folder).startswith("shots")  # fewshot's leaf
        return " / ".join(parts + ([f"{self.shots} shots"] if varies else []))


ROW_LABELS = {"zeroshot": "CLIP (zero-shot)",
              "linear-probe": "Linear probe (frozen image features)", "dear": "DeAR",
              "dear-all-mixed": "DeAR, all heads mixed (no mask)",
              "dear-all-generalization": "DeAR, all heads generalization",
              "dear-no-attribute-tokens": "DeAR, no attribute tokens (class branch, text tokens)",
              "dear-no-fusion-reg": "DeAR, no fusion regularisation (lambda_fusion 0)",
              "dear-mask-generalization-only": "DeAR, mask on the generalization heads only",
              "dear-branch-ce": "DeAR + per-branch CE (MMRL's; not the paper's loss)",
              "dear-shuffled-heads": "DeAR, the analysed roles on shuffled heads",
              "dear-whole-layers": "DeAR, whole top layers mixed (as many heads open)",
              "dear-true-heads": "DeAR, the toy's true heads (those ablation singles out)",
              "dear-fixed-fusion": "DeAR, fusion weights fixed (MMRL's 0.7 to the class branch)",
              "dear-feature-fusion": "DeAR, features fused (one cosine), not logits",
              "dear-no-self-reg": "DeAR, no self-regularisation (lambda_reg 0)"}


# The DeAR row once per --fusion mode; its table key and label say what the mode does.
FUSION_ROWS = {"fused-everywhere": ("-fused", ", fused on every test set"),
               "class-on-unseen": ("-class-on-unseen", ", class branch alone on unseen classes")}


# What a comparison row does by construction, said once in the header instead of a warning per
# run (dear.branches_in_fusion's warning is for a map that leaves a token blind unasked).
ROWS_SAID = {"dear-all-mixed": "dear-all-mixed: every head mixed, no mask (deep prompting)",
             "dear-all-generalization": "dear-all-generalization: no head lets an attribute token "
             "read the image, so the class branch alone scores (by construction, no warning)"}


def call_header(settings, jobs: List[Job], runtime, threads: str) -> List[str]:
    """The lines that open a call's runs: what runs where, its rows, and what a comparison row does
    by construction (said once)."""
    processes = f" x {runtime.world} processes" if runtime.world > 1 else ""
    rows = list(dict.fromkeys(job.row for job in jobs))
    return [f"train.py: {settings['protocol']} on {', '.join(settings['dataset'])}, {len(jobs)} "
            f"runs; output {settings['output']} (log.txt: every line)",
            f"train.py: device {runtime.device}{processes}, {runtime.precision}, {threads}",
            f"train.py: attention {runtime.attention_why}", "train.py: rows " + ", ".join(rows)] \
        + [f"train.py: {ROWS_SAID[row]}" for row in rows if row in ROWS_SAID]


def row_name(roles: str) -> str:
    # analysed or a file: the DeAR row
    return "dear" if roles not in ROLE_ABLATIONS else f"dear-{roles}"


def dear_rows(settings) -> List[tuple]:
    """(row, roles, ablation) of each DeAR row, in table order: each --roles choice, then each of
    --ablations on the DeAR row's roles. An ablation whose one change is a --roles map is that
    row (one row, whichever asks: no-role-mask is all-mixed's); every ablation acts through
    dear.ablate (once per run: train.run_job)."""
    rows = [(row_name(roles), roles, ROLE_ROWS.get(roles)) for roles in settings["roles"]]
    source = next((r for r in settings["roles"] if r not in ROLE_ABLATIONS), None)  # analyse/file
    for name in settings["ablations"]:
        roles = ablation_roles(name)
        row = row_name(roles) if roles is not None else f"dear-{name}"
        if row not in [r for r, _, _ in rows]:
            rows.append((row, roles if roles is not None else source, name))
    return rows


def trained_datasets(settings) -> List[str]:
    # cross, dg: the source alone
    return [settings["source"]] if settings["source"] else list(settings["dataset"])


def plan_jobs(settings) -> List[Job]:
    """Every run of the call, in order. Zero-shot depends on neither seed nor shots: one run
    per dataset fills every seed's place in the tables."""
    jobs, out = [], settings["output"]  # in order: zero-shot, then the trained rows
    for dataset in trained_datasets(settings):
        if "zeroshot" in settings["method"]:
            jobs.append(Job(dataset, "zeroshot", None, None, None,
                            os.path.join(out, dataset, "zeroshot")))
        rows = [("linear-probe", None, None)] if "linear-probe" in settings["method"] else []
        rows += dear_rows(settings) if "dear" in settings["method"] else []
        for row, roles, ablation in rows:  # one run per shots x seed
            for shots in settings["shots"]:
                for seed in settings["seeds"]:
                    leaf = (f"seed{seed}" if settings["protocol"] != "fewshot"
                            else f"shots{shots}-seed{seed}")
                    folder = os.path.join(out, dataset, row, leaf)
                    jobs.append(Job(dataset, row, roles, seed, shots, folder, ablation))
    return jobs


def table_rows(settings) -> Dict[str, tuple]:
    """{table row: (job row, fusion mode)}: zero-shot; the linear probe; the DeAR row once per
    --fusion mode (its key ends in the mode's suffix); each ablation under the first mode."""
    rows = {"zeroshot": ("zeroshot", None), "linear-probe": ("linear-probe", None)}
    for row, roles, ablation in dear_rows(settings):
        one_change = roles in ROLE_ABLATIONS or ablation is not None
        for mode in settings["fusion"][:1] if one_change else settings["fusion"]:
            rows[row + ("" if one_change else FUSION_ROWS[mode][0])] = (row, mode)
    return rows


def row_label(row: str) -> str:
    for suffix, label in FUSION_ROWS.values():
        if row.endswith(suffix):
            return ROW_LABELS.get(row[: -len(suffix)], row[: -len(suffix)]) + label
    return ROW_LABELS.get(row, row)  # a row without a label shows its key


def job_settings(settings, job: Job) -> dict:
    """What decides a run's result: saved with it and compared on --resume."""
    # how to run may change, not what
    keep = {k: v for k, v in settings.items() if k not in RUN_CONTROL}
    return dict(keep, job=dict(dataset=job.dataset, row=job.row, roles=job.roles, seed=job.seed,
                               shots=job.shots, ablation=job.ablation))
