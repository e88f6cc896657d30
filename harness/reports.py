"""harness/reports.py -- what a call reports: each run's results.json record, the paper-shaped
tables (summary.md / .json, mean over seeds, HM of the means), the retrieval tables, and the
head analysis' concepts scored against a pool's labels (clusters.md). Called by train.py.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import asdict
from typing import Dict, List, Optional

import data
import dear
from .devices import Runtime
from .plan import Job, job_settings, row_label, table_rows
from .sources import encoder_line
from .files import write_json, write_text
from .runfolder import fusion_weights_by_branch


DG_NAMES = {"imagenet": "ImageNet", "imagenet_v2": "-V2", "imagenet_sketch": "-Sketch",
            "imagenet_a": "-A",
            "imagenet_r": "-R"}  # the DG table's columns, as the paper names them


def harmonic_mean(base: float, novel: float) -> float:
    if math.isnan(base) or math.isnan(novel):
        return math.nan  # a row without a novel number (the linear probe) has no HM
    return 2 * base * novel / (base + novel) if base + novel > 0 else 0.0


def mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else math.nan  # nan: an empty cell, stored as null


def spread(values: List[float]) -> float:
    """Sample standard deviation over seeds (0 for a single run, e.g. zero-shot)."""
    if len(values) < 2:
        return 0.0
    return math.sqrt(sum((v - mean(values)) ** 2 for v in values) / (len(values) - 1))


def paragraph(text: str) -> List[str]:
    """A paragraph of a markdown file in lines of at most 100 characters (it reads the same, and
    prints without a line that runs off the screen)."""
    import textwrap

    return textwrap.wrap(text, width=100, break_long_words=False, break_on_hyphens=False)


def md_table(corner: str, columns: List[str], rows: Dict[str, List[str]]) -> List[str]:
    """A markdown table's lines: the header, then one line per row (numbers right-aligned)."""
    return ["| " + " | ".join([corner, *columns]) + " |", "|---|" + "---:|" * len(columns)] + \
        ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows.items()]


def job_table(label: str, metrics: dict) -> str:
    return "\n".join(md_table("run", list(metrics),
                              {label: [f"{v:.2f}" for v in metrics.values()]})) + "\n"


def summarise(settings, results: List[dict]) -> dict:
    """-> {"rows", "tables": {name: {"columns", "rows": {row: [values]}, "spread"?}}, "logits"}
    with the values rounded to two decimals exactly as the markdown shows them."""
    protocol, datasets = settings["protocol"], settings["dataset"]
    spec = {row: job_row_mode for row, job_row_mode in table_rows(settings).items()
            if any(res["job"]["row"] == job_row_mode[0] for res in results)}
    rows = list(spec)

    def seed_values(dataset: str, row: str, metric: str,
                    shots: Optional[int] = None) -> List[float]:
        # each seed's number under the row's fusion mode (spec[row][1])
        return [res.get("metrics_by_fusion", {}).get(spec[row][1], res["metrics"])
                .get(metric, math.nan)
                for res in results if res["job"]["row"] == spec[row][0]
                and res["job"]["dataset"] == dataset
                and (shots is None or res["job"]["shots"] in (None, shots))]

    def cell(dataset: str, row: str, metric: str, shots: Optional[int] = None) -> float:
        return mean(seed_values(dataset, row, metric, shots))

    logits = {}  # which logits scored each test set, per row (the same for every seed and dataset)
    for row in rows:
        res = next(res for res in results if res["job"]["row"] == spec[row][0])
        logits[row] = res.get("logits_by_fusion", {}).get(spec[row][1], res.get("logits", {}))
    tables: Dict[str, dict] = {}
    if protocol in ("base2novel", "fewshot"):  # a table per dataset, after their average's
        b2n = protocol == "base2novel"
        metrics = [("base", None), ("novel", None)] if b2n else [("all", k)
                                                                 for k in settings["shots"]]
        columns = ["Base", "Novel", "HM"] if b2n else [f"{k} shot{'s' if k > 1 else ''}"
                                                       for _, k in metrics]
        per = {d: {row: [cell(d, row, m, k) for m, k in metrics] for row in rows} for d in datasets}
        if len(datasets) > 1:  # base2novel: its HM below is of the average base and novel
            per = {f"Average over {len(datasets)} datasets": {
                row: [mean([per[d][row][i] for d in datasets]) for i in range(len(metrics))]
                for row in rows}, **per}
        for name, values in per.items():
            tables[name] = dict(columns=columns, rows={row: v + [harmonic_mean(*v)] if b2n else v
                                                       for row, v in values.items()})
            # the spread over seeds of base, novel and each seed's own HM
            if b2n and name in datasets:
                seeds = {row: (seed_values(name, row, "base"), seed_values(name, row, "novel"))
                         for row in rows}
                tables[name]["spread"] = {row: [spread(b), spread(n),
                                                spread(list(map(harmonic_mean, b, n)))]
                                          for row, (b, n) in seeds.items()}
    # cross and dg: one training on the source; other datasets and ImageNet's variants get a table
    # each
    else:
        source = settings["source"]
        for title, dg in (("Cross-dataset evaluation", False), ("Domain generalization", True)):
            targets = [t for t in datasets if data.get_spec(t).evaluation_only == dg]
            if targets:
                values = {row: [cell(source, row, t) for t in [source] + targets] for row in rows}
                names = [DG_NAMES.get(n, n) if dg else n for n in [source] + targets]
                tables[f"{title}: trained on {source}, tested on {len(targets)} targets"] = dict(
                    columns=[f"{names[0]} (source)"] + names[1:] + ["Average"],
                    # the targets' average
                    rows={row: v + [mean(v[1:])] for row, v in values.items()})
    for table in tables.values():  # an empty cell (nan) is stored as null
        for key in set(table) & {"rows", "spread"}:
            table[key] = {row: [None if math.isnan(v) else round(v, 2) for v in vals]
                          for row, vals in table[key].items()}
    betas = next((res["test_beta"] for res in results if res.get("test_beta")), None)  # {set: beta}
    test_beta = betas if settings["test_beta"] else None  # cross and dg: said under the table
    return dict(protocol=protocol, seeds=settings["seeds"], rows=rows, tables=tables, logits=logits,
                alpha=fusion_weights(settings, results), test_beta=test_beta)


def fusion_weights(settings, results: List[dict]) -> dict:
    """{trained dataset: {DeAR row (in fewshot: ", N shots" added): {branch: [mean, sd]}}}: the
    learned alpha of the class branch and of each attribute token over seeds (left out: 0)."""
    weights: Dict[str, dict] = {}
    for res in results:
        if res.get("alpha"):
            job = res["job"]
            shots = f", {job['shots']} shots" if settings["protocol"] == "fewshot" else ""
            key = job["row"] + shots
            row = weights.setdefault(job["dataset"], {}).setdefault(key, {})
            for branch, value in res["alpha"].items():
                row.setdefault(branch, []).append(value)
    def summed(values: List[float]) -> List[float]:
        return [round(mean(values), 3), round(spread(values), 3)]

    return {dataset: {key: {branch: summed(v) for branch, v in row.items()}
                      for key, row in rows.items()}
            for dataset, rows in weights.items()}


def markdown(summary: dict, settings) -> str:
    titles = dict(base2novel="Base-to-novel generalization", fewshot="Few-shot classification")
    # cross, dg:
    title = titles.get(settings["protocol"], "Cross-dataset evaluation and domain generalization")
    shots = settings["shots"]
    shots = ("shots " + ", ".join(map(str, shots)) if settings["protocol"] == "fewshot"
             else f"{shots[0]} shots")
    # the weights' path on a line of its own: no prose wraps around it, whatever the folder's name
    lines = [f"# {title}", "", f"CLIP weights: {settings['weights']}", "",
             *paragraph(f"Accuracy (%), mean over seeds {', '.join(map(str, settings['seeds']))}; "
                        f"{shots}. Zero-shot CLIP does not train: one run serves every seed. ± = "
                        "standard deviation over seeds; - = no number (the linear probe has no "
                        "classifier for unseen classes)."), ""]
    diverged = summary.get("diverged") or {}  # {job row: its diverged runs' lines}
    job_rows = table_rows(settings)

    def label(row: str) -> str:  # a row with diverged runs says so
        runs_lost = len(diverged.get(job_rows.get(row, (row,))[0], []))
        return row_label(row) + (f" ({runs_lost} run{'s' * (runs_lost > 1)} diverged, "
                                 "not in the mean)" if runs_lost else "")

    for name, table in summary["tables"].items():
        spreads = table.get("spread", {})  # ± only where seeds differ
        cells = {label(row): ["-" if v is None else f"{v:.2f}" + (f" ± {d:.2f}" if d else "")
                              for v, d in zip(values, spreads.get(row, [None] * len(values)))]
                 for row, values in table["rows"].items()}
        lines += [f"## {name}", "", *md_table("Method", table["columns"], cells), ""]
    lines += ["Notes on the data:", *(f"- {note}" for note in summary["notes"]), ""] \
        if summary.get("notes") else []
    lines += [f"Diverged (no number; --resume continues it from its last finite checkpoint): "
              f"{line}" for lines_of_row in diverged.values() for line in lines_of_row]
    lines += [""] if diverged else []
    lines += [f"fp16's loss scaler, {label}: {r['skipped_steps']} of {r['steps']} steps skipped "
              f"({100 * r['skipped_share']:.1f}%), final scale {r['loss_scale']:g}"
              for label, r in summary.get("fp16", {}).items()]
    lines += [""] if summary.get("fp16") else []
    names = {"fused": "fused", "class": "class branch alone", "clip": "CLIP"}
    lines += paragraph("Logits per test set (fused = DeAR's fusion with the weights learned on "
                       "the training classes; class branch alone = MMRL's rule for classes not "
                       "trained):")
    for row, used in summary.get("logits", {}).items():
        if used:
            lines.append(f"- {row_label(row)}: " + ", ".join(f"{test} {names.get(kind, kind)}"
                                                             for test, kind in used.items()))
    fallen = [name for name, record in (settings.get("role_maps") or {}).items()
              if record.get("class_branch_only")]
    if fallen:  # dear.falls_back_to_class_branch: both DeAR rows are then the class branch's
        lines.append(f"- The head analysis of {', '.join(fallen)} names no attribute head: DeAR "
                     "falls back to the class branch alone there.")
    if summary.get("test_beta"):  # cross and dg: the beta DeAR was tested at, per test set
        rule = ("MMRL++'s per target (trainers/config.py, task CD; the trained set and a target "
                "it does not name: the training beta)" if settings["test_beta"] == "per-target"
                else "the training beta on every target (--test-beta trained)")
        betas = ", ".join(f"{name} {beta:g}" for name, beta in summary["test_beta"].items())
        lines.append(f"- DeAR's beta at test time, {rule}: {betas}")
    return "\n".join(lines + [""] + fusion_weights_markdown(summary.get("alpha") or {}))


def fusion_weights_markdown(alpha: dict) -> List[str]:
    """The learned fusion weights: a row per DeAR row (and dataset), a column per branch."""
    if not alpha:
        return []

    def label(dataset: str, key: str) -> str:  # key: a row, in fewshot with ", N shots"
        row, _, shots = key.partition(", ")
        where = f"{dataset}: " if len(alpha) > 1 else ""
        return where + row_label(row) + (f", {shots}" if shots else "")

    branches = list(dict.fromkeys(b for rows in alpha.values() for row in rows.values()
                                  for b in row))
    cells = {label(dataset, key): [f"{row[b][0]:.2f} ± {row[b][1]:.2f}" if b in row else "-"
                                   for b in branches]
             for dataset, rows in alpha.items() for key, row in rows.items()}
    return ["## Learned fusion weights alpha (mean ± sd over seeds)", "",
            "Each branch's weight in the fused logits (class branch, then each attribute token); "
            "- = no such branch.", "", *md_table("DeAR run", branches, cells), ""]


def retrieval_summary(results: List[dict], attributes: List[str], k: int):
    """Precision@k per (feature, attribute), mean and spread over a DeAR row's seeds -> (JSON,
    markdown)."""
    summary, lines = {}, []
    for row in dict.fromkeys(res["job"]["row"] for res in results if res.get("retrieval")):
        tables = [res["retrieval"] for res in results if res["job"]["row"] == row
                  and res.get("retrieval")]
        seeds = lambda name, a: [t[name][a] for t in tables]  # noqa: E731
        summary[row] = {name: {a: "blind" if "blind" in seeds(name, a) else
                               [100 * mean(seeds(name, a)), 100 * spread(seeds(name, a))]
                               for a in attributes} for name in tables[0]}
        cells = {{"class": "class feature",
                  "frozen CLIP": "frozen CLIP"}.get(name, f"{name} token"):
                 ["blind" if v == "blind" else f"{v[0]:.1f} ± {v[1]:.1f}" for v in values.values()]
                 for name, values in summary[row].items()}
        lines += [f"## {row_label(row)}: precision@{k} (%) of same-value retrieval, mean ± sd "
                  f"over {len(tables)} seeds", "",
                  *md_table("ranked by", [f"same {a}" for a in attributes], cells), ""]
    text = "\n".join(["# Attribute-conditioned retrieval", "", *paragraph(
        "Gallery: the test split; each test image queries the others by one feature (cosine); a "
        "hit is a neighbour with the query's value. Chance = the value's share of the test "
        "images. A blind token cannot read the image and ranks nothing."), "", *lines])
    return summary, text


# A test column over fewer classes than this is said to be near a given (our choice): one class
# scores 100% whatever the model, two are a coin's choice.
FEW_CLASSES = 3


def small_data_notes(lists) -> List[str]:
    """What a small dataset does to the table, said under it (train.RunData `lists`): a column
    over fewer than FEW_CLASSES classes, and draws whose classes hold fewer distinct images than
    the shots asked (the draw repeats them: data.sample_few_shot)."""
    notes = []
    for dataset, eval_sets in lists.test.items():
        for eval_set in eval_sets:
            n = len(eval_set.classnames)
            if n < FEW_CLASSES:
                meaning = ("every image has one answer, so 100% is a given, not a result" if n == 1
                           else f"chance is {100 / n:.0f}%")
                notes.append(f"{dataset}'s {eval_set.name} column scores among {n} "
                             f"class{'es' * (n > 1)}: {meaning}.")
    short = {}  # (dataset, shots) -> the fewest and most distinct images of a class, any seed
    for (dataset, _, shots), split in lists.train.items():
        distinct = Counter(item.label for item in set(split.train)).values()  # per class
        if distinct and min(distinct) < shots:
            low, high = short.get((dataset, shots), (shots, 0))
            short[dataset, shots] = min(low, *distinct), max(high, *distinct)
    return notes + [f"{dataset}: {shots} shots asked, but "
                    + (f"each class holds only {low}" if low == high else
                       f"its classes hold {low} to {high}")
                    + " distinct training images; the draw repeats them to make the shots."
                    for (dataset, shots), (low, high) in short.items()]


def write_summaries(settings, results: List[dict], diverged: List[dict], notes: List[str],
                    attributes: List[str], k: int, runtime: Runtime) -> None:
    """summary.json / .md (and, where a run measured retrieval, retrieval.json / .md), printed
    too. A diverged run has no number: its row says so, and the means are over the others. The
    notes (small_data_notes) follow the tables."""
    summary = summarise(settings, results)
    summary["notes"] = notes
    summary["diverged"] = {record["job"]["row"]: [] for record in diverged}
    for record in diverged:
        summary["diverged"][record["job"]["row"]].append(record["diverged"])
    fp16 = {Job(**r["job"]).label: r["fp16"] for r in results if r.get("fp16")}
    if fp16:  # fp16's loss scaler per run (fp32: no key, summary.md unchanged)
        summary["fp16"] = fp16
    files = dict(summary=(summary, markdown(summary, settings)))
    # the toy world: attribute-conditioned retrieval
    if any(res.get("retrieval") for res in results):
        files["retrieval"] = retrieval_summary(results, attributes, k)
    for name, (value, text) in files.items():
        if runtime.main:
            write_json(os.path.join(settings["output"], f"{name}.json"), value)
            write_text(os.path.join(settings["output"], f"{name}.md"), text)
        if name == "summary":  # the tables, printed; retrieval's in its file (and the logs)
            runtime.log("\n" + text)
        else:
            runtime.detail("\n" + text)
            runtime.log(f"train.py: {name} tables in "
                        f"{os.path.join(settings['output'], name + '.md')}")


def adjusted_rand_index(a: list, b: list) -> float:
    """Hubert and Arabie's adjusted Rand index of two partitions of the same items (1: the same,
    about 0: as alike as chance)."""
    def pairs(counts) -> float:
        return sum(c * (c - 1) / 2 for c in counts)
    both, rows, cols = (pairs(Counter(zip(a, b)).values()), pairs(Counter(a).values()),
                        pairs(Counter(b).values()))
    expected, top = rows * cols / max(pairs([len(a)]), 1), (rows + cols) / 2
    return 1.0 if top == expected else (both - expected) / (top - expected)


def concepts_line(role_map: dear.RoleMap) -> str:
    """The analysis' concepts in one line: the pool's labels, or the clusters found (and, where
    none was, what that means for the roles)."""
    concepts = [c for h in role_map.heads for c in h.concepts]
    if role_map.concepts != "clusters":
        return f"concepts: the pool's labels ({', '.join(sorted(set(concepts)))})"
    picks = len({t for h in role_map.heads for t in h.descriptions})
    noise = len({t for h in role_map.heads for t, c in zip(h.descriptions, h.concepts)
                 if c == dear.NOISE})
    if not role_map.clusters:
        return (f"concepts: {picks} distinct picks in no cluster: each is a concept of its own, "
                "so every head spreads over its picks (no attribute head); clusters.md")
    named = ", ".join(f"{c.id} {c.name} ({c.size})" for c in role_map.clusters)
    return (f"concepts: {picks} distinct picks, {len(role_map.clusters)} clusters ({noise} in "
            f"none): {named}; clusters.md")


def clusters_table(role_map: dear.RoleMap, labels: Dict[str, str], encoder: dict) -> str:
    """clusters.md: the concepts of an analysis and the encoder that embedded them; where the picks
    have labels ({text: label}: scoring_labels), how the clusters agree with them over the distinct
    picks (noise picks each their own cluster, as in the entropy)."""
    picks = dict(zip((t for h in role_map.heads for t in h.descriptions),
                     (c for h in role_map.heads for c in h.concepts)))
    lines = [f"# Concepts of the head analysis: {role_map.concepts}", ""]
    if role_map.concepts != "clusters":
        return "\n".join(lines + [f"The pool's labels: {', '.join(sorted(set(picks.values())))}.",
                                  ""])
    lines += [f"Embedded by {encoder_line(encoder)}.", "",
              f"HDBSCAN over the {len(picks)} distinct picks of all heads; a name is a core "
              "attribute or other.",
              "", *md_table("cluster", ["name", "size", "its most central phrases"],
                            {str(c.id): [c.name, str(c.size), "; ".join(c.central)]
                             for c in role_map.clusters}),
              "", "In no cluster (noise, each a concept of its own): "
                  f"{list(picks.values()).count(dear.NOISE)} picks."]
    if all(labels.get(text) is not None for text in picks):
        found = [c if c != dear.NOISE else f"noise {text}" for text, c in picks.items()]
        truth = [labels[text] for text in picks]
        clustered = [(c, t) for c, t in zip(picks.values(), truth) if c != dear.NOISE]
        pure = sum(Counter(t for c2, t in clustered if c2 == c).most_common(1)[0][1]
                   for c in {c for c, _ in clustered})
        per_concept = {t: len({c for c, t2 in clustered if t2 == t}) for t in sorted(set(truth))}
        purity = f"{pure / len(clustered):.2f}" if clustered else "- (no pick in a cluster)"
        lines += ["", "Against the labels: adjusted Rand index "
                  f"{adjusted_rand_index(found, truth):.2f}, purity {purity} (clustered picks); "
                  "clusters per concept: "
                  + ", ".join(f"{t} {n}" for t, n in per_concept.items()) + "."]
    return "\n".join(lines + [""])


def evaluation_record(job: Job, settings, model, accuracy: dict, logits: dict, betas: dict) -> dict:
    """A zero-shot or DeAR job's results.json (retrieval added by train.run_job): "metrics" and
    "logits", the first --fusion mode's numbers and which logits scored each set (accuracy: {set:
    {kind of logits: top-1 %}}, logits: {mode: {set: kind}}); *_by_fusion: the same for every
    mode; role_map: the analysed map this run used, if any; alpha: DeAR's learned fusion weight
    per branch; parameters: its learnable ones per component; test_beta: each set's beta at
    test ({set: beta})."""
    by_fusion = {mode: {name: accuracy[name][kind] for name, kind in logits[mode].items()}
                 for mode in settings["fusion"]}
    for metrics in by_fusion.values():
        if settings["protocol"] == "base2novel":
            metrics["hm"] = harmonic_mean(metrics["base"], metrics["novel"])
    first = settings["fusion"][0]
    alpha = parameters = None
    if model is not None:
        alpha = fusion_weights_by_branch(model)
        counts = model.parameter_counts()  # per component of the token construction
        parameters = dict(tokens=model.construction, learnable=sum(counts.values()), components=counts)
    role_record = None
    if job.roles == "analyse":
        role_record = (settings["role_maps"] or {}).get(job.dataset)
    return dict(job=asdict(job), metrics=by_fusion[first], fusion=first, logits=logits[first],
                metrics_by_fusion=by_fusion, logits_by_fusion=logits, accuracy_by_logits=accuracy,
                role_map=role_record, alpha=alpha, parameters=parameters, test_beta=betas or None,
                settings=job_settings(settings, job))
