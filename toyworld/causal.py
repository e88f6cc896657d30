"""
toyworld/causal.py -- does concept entropy name what a head *does*? A measured check by ablation.

DeAR (paper Sec. 3.2) calls a head an "attribute head for colour" because the text directions
its output varies along are mostly colour words: a correlational reading. In the toy world the
causal question can be asked, because every image's attribute values are known: replace a head's
output by its mean over reference images (mean-ablation), measure zero-shot accuracy per
attribute with partial-caption prompts ("a photo of a red object" vs "... blue object" ...),
and compare the drop from the unablated model (what the head carried) with the head's role.

What is measured per head and attribute: the drop in zero-shot *accuracy* (as a fraction:
0.05 = 5 points) and in the mean *log-probability* of the true value (in nats). Accuracy
saturates: when colour is recognised at 100% by a wide margin, removing one colour head rarely
flips a prediction, though it visibly lowers the model's confidence. So agreement is decided on
the log-probability drops.

Agreement, as defined here (our choice; the paper runs no such test):
    A head's drops *single out* an attribute when its largest drop is at least MIN_DROP
    (0.05 nats) and at least DOMINANCE (2) times the second largest drop (a negative second
    drop counts as 0).
      - an attribute head for `a` agrees  iff  its drops single out `a`;
      - a generalization head agrees      iff  its drops single out no attribute;
      - a mixed head is reported but not scored (it is by definition in between).
    The agreement rate is agreements / scored heads (attribute + generalization heads).

How the ablation works: clip_model's attention puts the heads side by side, (B, N, H*D), right
before `attn.out_proj` mixes them, so head h's output is channels [h*D, (h+1)*D) of out_proj's
*input*, which a forward pre-hook reads or overwrites; removing the hook restores the model.

The whole head and its direct path: removing a head's output also changes what later layers read.
Concept entropy reads only its *direct* contribution to the image embedding (TextSpan's decomposition,
clip_model.head_contributions), so each head is also ablated there alone (its term of the decomposed
embedding set to its mean), by the same rule. A head whose whole removal singles out an attribute and
whose direct path does not acts through later layers, where no reading of its direct term can see it.

Try it:  python -m toyworld --scale miniature --causal
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch

import clip_model
import dear
from toyworld import world
from toyworld.pretrain import draw_batch, prompt_features, zero_shot_scores

MIN_DROP, DOMINANCE = 0.05, 2.0  # nats of log-probability; times the second drop (see above)

# ---- 1. Reading and replacing one head's output ------------------------------------------
@torch.no_grad()
def mean_head_outputs(model: clip_model.CLIP, images: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """For each layer, the mean over `images` of out_proj's input: (N, H*D), i.e. every
    head's mean output at every token position (heads side by side)."""
    means: dict[int, torch.Tensor] = {}
    handles = []
    for layer in layers:
        def record(module, inputs, layer=layer):
            means[layer] = inputs[0].mean(dim=0)  # (B, N, C) -> (N, C)
        handles.append(model.visual.transformer.resblocks[layer].attn.out_proj.register_forward_pre_hook(record))
    try:
        model.encode_image(images)
    finally:
        for handle in handles:
            handle.remove()
    return means


@contextlib.contextmanager
def ablate_heads(model: clip_model.CLIP, heads: Sequence[tuple[int, int]],
                 means: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside the block, each head of `heads` ((layer, head) pairs, 0-based, vision tower)
    outputs its mean from mean_head_outputs (its own D channels of means[layer], (N, H*D))
    instead of what it computes. Pre-hooks on one out_proj chain (each sees the previous
    one's output), so heads of one layer combine. The hooks are removed on leaving."""
    handles = []
    for layer, head in heads:
        attn = model.visual.transformer.resblocks[layer].attn

        def replace(module, inputs, channels=slice(head * attn.head_dim, (head + 1) * attn.head_dim),
                    mean_output=means[layer]):
            merged = inputs[0].clone()  # (B, N, H*D): never write into the attention's own tensor
            merged[..., channels] = mean_output[..., channels].to(merged.dtype)  # broadcast over B
            return (merged,)

        handles.append(attn.out_proj.register_forward_pre_hook(replace))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def head_groups(role_map: dear.RoleMap, attributes: Sequence[str]) -> list[dict]:
    """The groups ablated together: all heads of one role, and all heads concept entropy names for one
    attribute (when three heads carry colour, removing one costs little; removing the three does not).
    Each non-empty group: {"name", "heads": [(layer, head)], "expects": the attribute its removal should
    single out, None for none (generalization heads), or "-" (not scored: mixed, all attribute heads)}."""
    groups = []
    for role, expects in (("attribute", "-"), ("generalization", None), ("mixed", "-")):
        members = [(h.layer, h.head) for h in role_map.heads if h.role == role]
        groups.append({"name": f"all {role} heads", "heads": members, "expects": expects})
    for attribute in attributes:
        members = [(h.layer, h.head) for h in role_map.heads if h.role == "attribute" and h.attribute == attribute]
        groups.append({"name": f"{attribute} heads (entropy)", "heads": members, "expects": attribute})
    return [group for group in groups if group["heads"]]


# ---- 2. The check ------------------------------------------------------------------------
def _singled_out(drops: dict[str, float], min_drop: float, dominance: float) -> Optional[str]:
    """The attribute the drops single out (see the module docstring), or None."""
    ranked = sorted(drops.items(), key=lambda item: -item[1])
    (top, top_drop), second_drop = ranked[0], max(ranked[1][1], 0.0) if len(ranked) > 1 else 0.0
    return top if top_drop >= min_drop and top_drop >= dominance * second_drop else None


def _rate(units: list[dict]) -> tuple[Optional[float], int]:
    """(share of the scored units that agree, or None if none is scored; how many are scored)."""
    scored = [unit["agrees"] for unit in units if unit["agrees"] is not None]
    return (sum(scored) / len(scored) if scored else None), len(scored)


@torch.no_grad()
def causal_check(clip: clip_model.CLIP, tokenizer: clip_model.SimpleTokenizer, role_map: dear.RoleMap,
                 attributes: Sequence[str] = tuple(world.ATTRIBUTES), n_images: int = 512,
                 log: Callable[[str], None] = print) -> dict:
    """Mean-ablate every head the RoleMap covers, and groups of them, and compare the drops
    with the roles, on n_images fresh toy images (another n_images for the means).
    Returns {"baseline": {attribute: {"accuracy", "log_prob"}}, "heads": [one dict per head:
    layer (0-based), head, role, attribute, entropy, drops {attribute: accuracy lost, as a
    fraction}, log_prob_drops {attribute: nats lost}, top_attribute (largest drop by
    log-probability), singled_out (attribute or None), agrees (True/False, None for mixed), direct (the
    same for its direct path alone)], "agreement_rate": float or None, "scored": int,
    "direct_agreement_rate", "groups" (the same per group, with name, heads, expects),
    "group_agreement_rate", "groups_scored", "measure", "min_drop", "dominance", "table": markdown}.
    """
    clip = clip.eval()
    size = clip.visual.input_resolution
    images, scenes = draw_batch(1, n_images, size, "pretrain")  # seed 1; the means' seed 2
    reference, _ = draw_batch(2, n_images, size, "pretrain")
    text = prompt_features(clip, tokenizer, attributes)  # the text side is never ablated
    baseline = zero_shot_scores(clip, images, scenes, text)
    means = mean_head_outputs(clip, reference, role_map.layers)
    # The direct paths: every head's term of the decomposed embedding, (B, L, H, E), and its mean.
    parts = clip_model.head_contributions(clip, images, len(clip.visual.transformer.resblocks) - min(role_map.layers))
    mean_terms = clip_model.head_contributions(clip, reference, len(parts.layers)).heads.mean(dim=0)  # (L, H, E)
    embeddings = parts.total()  # (B, E): encode_image's, to float tolerance

    def drops_to(scores: dict) -> dict:
        """The drops from the baseline to `scores`, and the attribute they single out."""
        drops = {"drops": {name: baseline[name]["accuracy"] - scores[name]["accuracy"] for name in attributes},
                 "log_prob_drops": {name: baseline[name]["log_prob"] - scores[name]["log_prob"] for name in attributes}}
        decisive = drops["log_prob_drops"]
        return {**drops, "top_attribute": max(decisive, key=decisive.get),
                "singled_out": _singled_out(decisive, MIN_DROP, DOMINANCE)}

    def ablated(heads: Sequence[tuple[int, int]]) -> dict:
        with ablate_heads(clip, heads, means):
            return drops_to(zero_shot_scores(clip, images, scenes, text))

    def agreement(role: str, attribute: Optional[str], singled_out: Optional[str]) -> Optional[bool]:
        return {"attribute": singled_out == attribute, "generalization": singled_out is None}.get(role)

    rows = []
    for entry in role_map.heads:
        row = {"layer": entry.layer, "head": entry.head, "role": entry.role, "attribute": entry.attribute,
               "entropy": entry.entropy, **ablated([(entry.layer, entry.head)])}
        li = parts.layers.index(entry.layer)  # its direct path alone: its term of the embedding set to its mean
        edited = embeddings - parts.heads[:, li, entry.head] + mean_terms[li, entry.head]
        direct = drops_to(zero_shot_scores(clip, images, scenes, text, edited))
        row["agrees"] = agreement(entry.role, entry.attribute, row["singled_out"])
        row["direct"] = {**direct, "agrees": agreement(entry.role, entry.attribute, direct["singled_out"])}
        rows.append(row)

    # The same for groups removed together: those concept entropy defines, and per attribute the heads
    # whose own ablation singles it out (not scored: the yardstick).
    by_ablation = [{"name": f"{attribute} heads (ablation)",
                    "heads": [(row["layer"], row["head"]) for row in rows if row["singled_out"] == attribute],
                    "expects": "-"} for attribute in attributes]
    groups = []
    for group in head_groups(role_map, attributes) + [group for group in by_ablation if group["heads"]]:
        unit = ablated(group["heads"])
        agrees = None if group["expects"] == "-" else unit["singled_out"] == group["expects"]
        groups.append({**group, **unit, "agrees": agrees})
    (rate, scored), (group_rate, groups_scored) = _rate(rows), _rate(groups)

    result = {"baseline": baseline, "heads": rows, "agreement_rate": rate, "scored": scored,
              "direct_agreement_rate": _rate([row["direct"] for row in rows])[0], "groups": groups,
              "group_agreement_rate": group_rate, "groups_scored": groups_scored,
              "measure": "log_prob", "min_drop": MIN_DROP, "dominance": DOMINANCE}
    result["constant_rates"] = _constant_rates(rows)
    result["table"] = causal_table(result, attributes)
    for line in summary_lines(result, n_images):
        log(line)
    return result


def true_role_map(result: dict, role_map: dear.RoleMap) -> dear.RoleMap:
    """What a perfect head analysis would give (the true-heads row, dear.ablate): over the map's
    heads, each head whose own ablation singles out an attribute an attribute head for it, every
    other head generalization. result: causal_check's (or its causal_check.json)."""
    singled = {(row["layer"], row["head"]): row["singled_out"] for row in result["heads"]}
    heads = [dear.HeadRole(h.layer, h.head, "attribute" if singled.get((h.layer, h.head))
                           else "generalization", singled.get((h.layer, h.head)))
             for h in role_map.heads]
    return dear.RoleMap(role_map.vision_layers, role_map.num_heads, list(role_map.attributes),
                        heads, source="true heads (the toy world's causal check)")


def _constant_rates(rows: list) -> dict:
    """{role: the agreement of a map that gave every scored head that role}: the floor a real
    agreement is to be read against (a map calling every head generalization agrees wherever
    ablation singles nothing out)."""
    as_generalization = [{"agrees": None if row["agrees"] is None else row["singled_out"] is None}
                         for row in rows]  # the heads scored, each as a generalization head
    return {"generalization": _rate(as_generalization)[0]}


def summary_lines(result: dict, n_images: int) -> list:
    """The check in a few lines: which heads ablation singles out and which concept entropy
    names, and the agreement beside what calling every head generalization would score (said
    plainly where every scored head has one role, where the agreement measures nothing)."""
    rows = result["heads"]
    singled = [row for row in rows if row["singled_out"]]
    named = sum(row["attribute"] == row["singled_out"] for row in singled)
    heads = ", ".join(f"{row['layer'] + 1}.{row['head']} {row['singled_out']}" for row in singled)
    roles = {row["role"] for row in rows if row["agrees"] is not None}
    constant = result["constant_rates"]["generalization"]
    verdict = ["causal check: every scored head has the same role, so this agreement says nothing "
               "about concept entropy"] if len(roles) == 1 else []
    return [f"causal check: {len(rows)} heads ablated on {n_images} images; ablation singles out "
            f"{len(singled)} ({heads or 'none'}), concept entropy names {named} of them",
            f"causal check: agreement {_percent(result['agreement_rate'])} of {result['scored']} "
            f"scored heads; calling every head generalization would score {_percent(constant)}",
            *verdict]


# ---- 3. The table ------------------------------------------------------------------------
def _percent(rate: Optional[float]) -> str:
    return "n/a" if rate is None else f"{rate:.0%}"


def _role(row: dict, entropy: bool = False) -> str:
    """"attribute:colour", with " (0.85 b)" when `entropy` and the row has one."""
    named = row["role"] + (f":{row['attribute']}" if row["attribute"] else "")
    return named + ("" if not entropy or row["entropy"] is None else f" ({row['entropy']:.2f} b)")


def causal_table(result: dict, attributes: Sequence[str]) -> str:
    """The check as markdown tables: one row per head (layers 1-based, as in the paper), one
    per group; each drop cell is "accuracy points / nats of log-probability"."""
    def cells(unit: dict) -> str:
        drops = " | ".join(f"{100 * unit['drops'][a]:+.1f} / {unit['log_prob_drops'][a]:+.2f}" for a in attributes)
        agrees = {True: "yes", False: "no", None: "-"}[unit["agrees"]]
        return f"{drops} | {unit['top_attribute']} | {unit['singled_out'] or '-'} | {agrees} |"

    columns = " | ".join(f"drop {a}" for a in attributes) + " | largest drop | singled out | agrees |"
    lines = ["| layer (1-based) | head | role (entropy) | " + columns + " direct path alone singles out |",
             "|" + "---|" * (7 + len(attributes))]
    lines.append("| baseline | | | " + " | ".join(
        f"{result['baseline'][a]['accuracy']:.0%} acc, {result['baseline'][a]['log_prob']:.2f} nats"
        for a in attributes) + " | | | | |")
    lines += [f"| {row['layer'] + 1} | {row['head']} | {_role(row, entropy=True)} | " + cells(row)
              + f" {row['direct']['singled_out'] or '-'} |" for row in result["heads"]]
    lines += ["", "| group (removed together) | heads | " + columns, "|" + "---|" * (5 + len(attributes))]
    lines += [f"| {group['name']} | {len(group['heads'])} | " + cells(group) for group in result["groups"]]
    # The yardstick first: the heads whose own removal singles out an attribute, what removing
    # their direct path alone costs it (all concept entropy reads), and what concept entropy calls them.
    lines += ["", "| head ablation singles out (layer.head, 1-based) | attribute | its drop, whole head / direct path "
              "alone (nats) | concept entropy names it |", "|---|---|---|---|"]
    for row in (row for row in result["heads"] if row["singled_out"]):
        whole, direct = (unit["log_prob_drops"][row["singled_out"]] for unit in (row, row["direct"]))
        named = " (named for it)" if row["attribute"] == row["singled_out"] else ""
        lines.append(f"| {row['layer'] + 1}.{row['head']} | {row['singled_out']} | {whole:+.3f} / {direct:+.3f} | "
                     f"{_role(row, entropy=True)}{named} |")
    lines.append("")
    lines.append(f"Agreement: {_percent(result['agreement_rate'])} of {result['scored']} scored heads "
                 f"({_percent(result['direct_agreement_rate'])} when only their direct paths are removed), "
                 f"{_percent(result['group_agreement_rate'])} of {result['groups_scored']} scored groups; "
                 f"a map calling every head generalization would score "
                 f"{_percent(result['constant_rates']['generalization'])} of the heads. "
                 f"Cells: accuracy points / nats of log-probability lost when the head is mean-ablated; its direct "
                 f"path alone: its term of the decomposed embedding set to its mean, what concept entropy reads. "
                 f"Attribute heads agree when their attribute is singled out, generalization heads when none "
                 f"is; singled out = largest {result['measure']} drop >= {result['min_drop']:g} nats and >= "
                 f"{result['dominance']:g}x the second; mixed heads are not scored. "
                 f"A group of an attribute's heads agrees when removing them singles it out, the generalization "
                 f"group when it singles out none; mixed heads and all attribute heads together are not scored.")
    return "\n".join(lines)
