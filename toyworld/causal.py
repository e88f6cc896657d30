"""
toyworld/causal.py -- does concept entropy name what a head *does*? A measured check by ablation.

DeAR (paper Sec. 3.2) calls a head an "attribute head for colour" because the text directions
its output varies along are mostly colour words. That is a correlational reading. In the toy
world we can ask the causal question directly, because every image's colour, shape, texture
and position are known:

    1. Reference: run the tiny CLIP over a reference set of images and record, for every
       analysed head, its mean output at every token position, (N, D).
    2. Ablate one head: replace its output by that mean (mean-ablation) and measure zero-shot
       accuracy per attribute with partial-caption prompts ("a photo of a red object" vs
       "... blue object" ...). The drop from the unablated model is what the head carried.
    3. Compare with the head's role from the RoleMap.

What is measured per head and attribute: the drop in zero-shot *accuracy* (as a fraction:
0.05 = 5 points) and the drop in the mean *log-probability* of the true value (in nats).
Accuracy is the number one reports, but it saturates: when colour is recognised with 100%
accuracy by a wide margin, removing one colour head rarely flips a prediction, even though
it visibly lowers the model's confidence. So agreement is decided on the log-probability
drops by default (measure="log_prob"); measure="accuracy" decides on accuracy instead.

Agreement, as defined here (our choice; the paper runs no such test):
    A head's drops *single out* an attribute when its largest drop is at least `min_drop`
    (default 0.05 nats, or 0.02 = 2 points for accuracy) and at least `dominance` times
    (default 2x) the second largest drop (a negative second drop counts as 0).
      - an attribute head for `a` agrees  iff  its drops single out `a`;
      - a generalization head agrees      iff  its drops single out no attribute;
      - a mixed head is reported but not scored (it is by definition in between).
    The agreement rate is agreements / scored heads (attribute + generalization heads).

How the ablation works: `MultiHeadAttention` puts the heads side by side, (B, N, H*D), right
before `attn.out_proj` mixes them (clip_model.py), so head h's output is channels
[h*D, (h+1)*D) of out_proj's *input*. A forward pre-hook on `block.attn.out_proj` can read or
overwrite exactly that slice; removing the hook restores the model exactly.

How it fits: toyworld/__init__.py exports `causal_check`; train.py can call it with the RoleMap
from dear.analyze_heads on the toy CLIP and print its markdown table.

Try it:  python -m toyworld --scale miniature --causal
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

import clip_model
import dear
from toyworld import world
from toyworld.pretrain import draw_batch, prompt_features, zero_shot_scores

# ------------------------------------------------------------------------------------------
# 1. Reading and replacing one head's output
# ------------------------------------------------------------------------------------------


def _out_proj(model: clip_model.CLIP, layer: int) -> torch.nn.Linear:
    return model.visual.transformer.resblocks[layer].attn.out_proj


@torch.no_grad()
def mean_head_outputs(model: clip_model.CLIP, images: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """For each layer, the mean over `images` of out_proj's input: (N, H*D), i.e. every
    head's mean output at every token position (heads side by side)."""
    means: dict[int, torch.Tensor] = {}
    handles = []
    for layer in layers:
        def record(module, inputs, layer=layer):
            means[layer] = inputs[0].mean(dim=0)  # (B, N, C) -> (N, C)
        handles.append(_out_proj(model, layer).register_forward_pre_hook(record))
    try:
        model.encode_image(images)
    finally:
        for handle in handles:
            handle.remove()
    return means


@contextlib.contextmanager
def ablate_head(model: clip_model.CLIP, layer: int, head: int, mean_output: torch.Tensor) -> Iterator[None]:
    """Inside the block, head `head` of vision layer `layer` (0-based) outputs `mean_output`
    (its (N, H*D) mean from mean_head_outputs; only the head's own D channels are used)
    instead of what it computes. The hook is removed on leaving, whatever happens."""
    attn = model.visual.transformer.resblocks[layer].attn
    D = attn.head_dim
    channels = slice(head * D, (head + 1) * D)

    def replace(module, inputs):
        merged = inputs[0].clone()  # (B, N, H*D): never write into the attention's own tensor
        merged[..., channels] = mean_output[..., channels].to(merged.dtype)  # broadcast over B
        return (merged,)

    handle = attn.out_proj.register_forward_pre_hook(replace)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def ablate_heads(model: clip_model.CLIP, heads: Sequence[tuple[int, int]],
                 means: dict[int, torch.Tensor]) -> Iterator[None]:
    """Mean-ablate several heads at once ((layer, head) pairs, 0-based). Pre-hooks on one
    out_proj chain (each sees the previous one's output), so heads of one layer combine."""
    with contextlib.ExitStack() as stack:
        for layer, head in heads:
            stack.enter_context(ablate_head(model, layer, head, means[layer]))
        yield


def head_groups(role_map: dear.RoleMap, attributes: Sequence[str]) -> list[dict]:
    """The groups ablated together: all heads of one role, and all heads concept entropy
    names for one attribute (the attribute heads for it). Why groups: when colour is carried
    by three heads, removing any one of them costs little, and single-head ablation cannot
    tell "redundant" from "absent"; removing the three together can.

    Each group: {"name", "heads": [(layer, head)], "expects": the attribute its removal
    should single out, None for "no attribute" (generalization heads), or "-" (not scored:
    mixed heads, and all attribute heads together, which span several attributes)}. Empty
    groups are left out."""
    groups = []
    for role, expects in (("attribute", "-"), ("generalization", None), ("mixed", "-")):
        members = [(h.layer, h.head) for h in role_map.heads if h.role == role]
        groups.append({"name": f"all {role} heads", "heads": members, "expects": expects})
    for attribute in attributes:
        members = [(h.layer, h.head) for h in role_map.heads if h.role == "attribute" and h.attribute == attribute]
        groups.append({"name": f"{attribute} heads (entropy)", "heads": members, "expects": attribute})
    return [group for group in groups if group["heads"]]


def _selectivity(decisive: dict[str, float], attribute: str) -> float:
    """How much more removing a unit costs `attribute` than any other attribute:
    drop(attribute) - max drop(other) (negative drops count as 0)."""
    others = [max(value, 0.0) for name, value in decisive.items() if name != attribute]
    return decisive[attribute] - max(others, default=0.0)


# ------------------------------------------------------------------------------------------
# 2. The check
# ------------------------------------------------------------------------------------------


def _singled_out(drops: dict[str, float], min_drop: float, dominance: float) -> Optional[str]:
    """The attribute the drops single out (see the module docstring), or None."""
    ranked = sorted(drops.items(), key=lambda item: -item[1])
    (top, top_drop), second_drop = ranked[0], max(ranked[1][1], 0.0) if len(ranked) > 1 else 0.0
    return top if top_drop >= min_drop and top_drop >= dominance * second_drop else None


@torch.no_grad()
def causal_check(clip: clip_model.CLIP, tokenizer: clip_model.SimpleTokenizer, role_map: dear.RoleMap,
                 attributes: Sequence[str] = tuple(world.ATTRIBUTES), n_images: int = 512,
                 style: str = "pretrain", seed: int = 1, measure: str = "log_prob",
                 min_drop: Optional[float] = None, dominance: float = 2.0,
                 log: Callable[[str], None] = print) -> dict:
    """Mean-ablate every head the RoleMap covers and compare the drops with its role.

    Images are drawn fresh from the toy world (n_images to evaluate on, another n_images as the
    reference for the means), at the model's own resolution and in `style`.
    Returns {"baseline": {attribute: {"accuracy", "log_prob"}}, "heads": [one dict per head:
    layer (0-based), head, role, attribute, entropy, drops {attribute: accuracy lost, as a
    fraction}, log_prob_drops {attribute: nats lost}, top_attribute (largest drop by
    `measure`), singled_out (attribute or None), agrees (True/False, None for mixed)],
    "agreement_rate": float or None, "scored": int, "measure", "min_drop", "dominance",
    "table": markdown}.
    """
    if measure not in ("log_prob", "accuracy"):
        raise ValueError(f"measure={measure!r}: expected 'log_prob' or 'accuracy'")
    min_drop = min_drop if min_drop is not None else (0.05 if measure == "log_prob" else 0.02)
    clip = clip.eval()
    size = clip.visual.input_resolution
    images, scenes = draw_batch(random.Random(seed), np.random.default_rng(seed), n_images, size, style)
    reference, _ = draw_batch(random.Random(seed + 1), np.random.default_rng(seed + 1), n_images, size, style)
    text = prompt_features(clip, tokenizer, attributes)  # the text side is never ablated
    baseline = zero_shot_scores(clip, images, scenes, text)
    means = mean_head_outputs(clip, reference, role_map.layers)

    rows = []
    for entry in role_map.heads:
        with ablate_head(clip, entry.layer, entry.head, means[entry.layer]):
            ablated = zero_shot_scores(clip, images, scenes, text)
        drops = {name: baseline[name]["accuracy"] - ablated[name]["accuracy"] for name in attributes}
        log_prob_drops = {name: baseline[name]["log_prob"] - ablated[name]["log_prob"] for name in attributes}
        decisive = log_prob_drops if measure == "log_prob" else drops
        singled = _singled_out(decisive, min_drop, dominance)
        if entry.role == "attribute":
            agrees = singled == entry.attribute
        elif entry.role == "generalization":
            agrees = singled is None
        else:
            agrees = None  # mixed heads are not scored
        rows.append({"layer": entry.layer, "head": entry.head, "role": entry.role, "attribute": entry.attribute,
                     "entropy": entry.entropy, "drops": drops, "log_prob_drops": log_prob_drops,
                     "top_attribute": max(decisive, key=decisive.get), "singled_out": singled, "agrees": agrees})
    scored = [row for row in rows if row["agrees"] is not None]
    rate = sum(row["agrees"] for row in scored) / len(scored) if scored else None

    # The same for groups of heads removed together: the groups concept entropy defines, and,
    # per attribute, the heads whose own ablation singles it out (the group ablation itself
    # would name; not scored, it is the yardstick).
    by_ablation = []
    for attribute in attributes:
        members = [(row["layer"], row["head"]) for row in rows if row["singled_out"] == attribute]
        if members:
            by_ablation.append({"name": f"{attribute} heads (ablation)", "heads": members, "expects": "-"})
    groups = []
    for group in head_groups(role_map, attributes) + by_ablation:
        with ablate_heads(clip, group["heads"], means):
            ablated = zero_shot_scores(clip, images, scenes, text)
        drops = {name: baseline[name]["accuracy"] - ablated[name]["accuracy"] for name in attributes}
        log_prob_drops = {name: baseline[name]["log_prob"] - ablated[name]["log_prob"] for name in attributes}
        decisive = log_prob_drops if measure == "log_prob" else drops
        singled = _singled_out(decisive, min_drop, dominance)
        agrees = None if group["expects"] == "-" else singled == group["expects"]
        groups.append({**group, "drops": drops, "log_prob_drops": log_prob_drops,
                       "top_attribute": max(decisive, key=decisive.get), "singled_out": singled, "agrees": agrees})
    scored_groups = [group for group in groups if group["agrees"] is not None]
    group_rate = sum(g["agrees"] for g in scored_groups) / len(scored_groups) if scored_groups else None

    # Per attribute: the head or group whose removal costs it most compared with the others.
    def units():
        for row in rows:
            yield f"head {row['layer'] + 1}.{row['head']} ({row['role']}{':' + row['attribute'] if row['attribute'] else ''})", row
        for group in groups:
            yield group["name"], group

    best = {}
    for attribute in attributes:
        name, unit = max(units(), key=lambda item: _selectivity(
            item[1]["log_prob_drops" if measure == "log_prob" else "drops"], attribute))
        decisive = unit["log_prob_drops" if measure == "log_prob" else "drops"]
        best[attribute] = {"unit": name, "selectivity": _selectivity(decisive, attribute),
                           "singled_out": unit["singled_out"] == attribute}
    result = {"baseline": baseline, "heads": rows, "agreement_rate": rate, "scored": len(scored),
              "groups": groups, "group_agreement_rate": group_rate, "groups_scored": len(scored_groups),
              "best_per_attribute": best, "measure": measure, "min_drop": min_drop, "dominance": dominance}
    result["table"] = causal_table(result, attributes)
    named = sum(row["attribute"] == row["singled_out"] for row in rows if row["singled_out"])
    log(f"causal check: ablation singles out {sum(bool(row['singled_out']) for row in rows)} heads, concept "
        f"entropy names {named} of them for that attribute")
    log(f"causal check: {len(rows)} heads and {len(groups)} groups ablated on {n_images} images; agreement "
        f"{'n/a' if rate is None else f'{rate:.0%}'} of {len(scored)} scored heads, "
        f"{'n/a' if group_rate is None else f'{group_rate:.0%}'} of {len(scored_groups)} scored groups (by {measure})")
    return result


def causal_table(result: dict, attributes: Sequence[str]) -> str:
    """The check as a markdown table: one row per head, layers 1-based as in the paper; each
    drop cell is "accuracy points / nats of log-probability"."""
    header = ("| layer (1-based) | head | role (entropy) | " + " | ".join(f"drop {a}" for a in attributes)
              + " | largest drop | singled out | agrees |")
    lines = [header, "|" + "---|" * (6 + len(attributes))]
    lines.append("| baseline | | | " + " | ".join(
        f"{result['baseline'][a]['accuracy']:.0%} acc, {result['baseline'][a]['log_prob']:.2f} nats"
        for a in attributes) + " | | | |")
    for row in result["heads"]:
        role = row["role"] + (f":{row['attribute']}" if row["attribute"] else "")
        entropy = "" if row["entropy"] is None else f" ({row['entropy']:.2f} b)"
        agrees = {True: "yes", False: "no", None: "-"}[row["agrees"]]
        lines.append(f"| {row['layer'] + 1} | {row['head']} | {role}{entropy} | "
                     + " | ".join(f"{100 * row['drops'][a]:+.1f} / {row['log_prob_drops'][a]:+.2f}" for a in attributes)
                     + f" | {row['top_attribute']} | {row['singled_out'] or '-'} | {agrees} |")
    lines += ["", "| group (removed together) | heads | " + " | ".join(f"drop {a}" for a in attributes)
              + " | largest drop | singled out | agrees |", "|" + "---|" * (5 + len(attributes))]
    for group in result["groups"]:
        agrees = {True: "yes", False: "no", None: "-"}[group["agrees"]]
        lines.append(f"| {group['name']} | {len(group['heads'])} | "
                     + " | ".join(f"{100 * group['drops'][a]:+.1f} / {group['log_prob_drops'][a]:+.2f}" for a in attributes)
                     + f" | {group['top_attribute']} | {group['singled_out'] or '-'} | {agrees} |")
    # The yardstick first: the heads whose own removal singles out an attribute, and what
    # concept entropy calls them.
    lines += ["", "| head ablation singles out (layer.head, 1-based) | attribute | concept entropy names it |",
              "|---|---|---|"]
    for row in (r for r in result["heads"] if r["singled_out"]):
        named = row["role"] + (f":{row['attribute']}" if row["attribute"] else "")
        entropy = "" if row["entropy"] is None else f" ({row['entropy']:.2f} b)"
        lines.append(f"| {row['layer'] + 1}.{row['head']} | {row['singled_out']} | {named}{entropy}"
                     f"{' (named for it)' if row['attribute'] == row['singled_out'] else ''} |")
    lines += ["", "| attribute | most selective head or group | drop minus largest other drop | singled out |",
              "|---|---|---:|---|"]
    for attribute, best in result["best_per_attribute"].items():
        lines.append(f"| {attribute} | {best['unit']} | {best['selectivity']:+.2f} | {'yes' if best['singled_out'] else 'no'} |")
    rate, group_rate = result["agreement_rate"], result["group_agreement_rate"]
    unit = "nats" if result["measure"] == "log_prob" else "accuracy points"
    threshold = result["min_drop"] if result["measure"] == "log_prob" else 100 * result["min_drop"]
    lines.append("")
    lines.append(f"Agreement: {'n/a' if rate is None else f'{rate:.0%}'} of {result['scored']} scored heads, "
                 f"{'n/a' if group_rate is None else f'{group_rate:.0%}'} of {result['groups_scored']} scored groups. "
                 f"Cells: accuracy points / nats of log-probability lost when the head is mean-ablated. "
                 f"Attribute heads agree when their attribute is singled out, generalization heads when none "
                 f"is; singled out = largest {result['measure']} drop >= {threshold:g} {unit} and >= "
                 f"{result['dominance']:g}x the second; mixed heads are not scored. "
                 f"A group of an attribute's heads agrees when removing them singles it out, the generalization "
                 f"group when it singles out none; mixed heads and all attribute heads together are not scored.")
    return "\n".join(lines)
