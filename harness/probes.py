"""harness/probes.py -- the rows and checks beside DeAR that train.py runs for each dataset: CLIP's
linear probe (a ceiling for the base column: weak training, or weak features?) and the paper's
check that an attribute token carries its attribute (attribute-conditioned retrieval: pictures
in the run folder; in the toy world, where every image's attributes are known, precision@10).
Called by train.run_job.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch
import torch.nn.functional as F

import data
import dear
from . import devices, pictures, plan, sources


RETRIEVAL_GALLERY = 2000  # test images at most in the retrieval check (our choice: cost)


RETRIEVAL_QUERIES = 4  # picture rows
RETRIEVAL_SHOWN = 8  # neighbours shown
RETRIEVAL_K = 10  # precision@K


@torch.no_grad()
def image_features(clip, items: list, settings, runtime: devices.Runtime):
    """Normalised frozen CLIP image embeddings (test transform) -> ((n, E), labels (n,))."""
    features, labels = [], []
    for images, batch_labels in devices.loader_of(items, settings, clip.visual.input_resolution, runtime):
        with devices.autocast(runtime):
            embedded = clip.encode_image(images.to(runtime.device)).float()  # (B, E)
            features.append(F.normalize(embedded, dim=-1).cpu())
        labels.append(batch_labels)
    return torch.cat(features), torch.cat(labels)


def linear_probe(clip, split: data.DatasetSplits, eval_sets: list, settings,
                 runtime) -> Dict[str, float]:
    """CLIP's linear probe (Radford et al. 2021, Sec. 3.2): logistic regression on the frozen
    image embeddings of the few-shot images DeAR trains on, its L2 strength picked on the
    validation images: a ceiling for the base column, telling weak training from weak features.
    No classifier for untrained classes: those sets get no number. -> {set name: top-1 %}"""
    train_x, train_y = image_features(clip, split.train, settings, runtime)
    if split.val:
        val_x, val_y = image_features(clip, split.val, settings, runtime)
    else:  # no validation images: picked on the training images
        val_x, val_y = train_x, train_y

    def fit(l2: float) -> torch.nn.Linear:
        torch.manual_seed(0)
        probe = torch.nn.Linear(train_x.shape[1], len(split.classnames))
        optimizer = torch.optim.LBFGS(probe.parameters(), lr=1.0, max_iter=300,
                                      line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = F.cross_entropy(probe(train_x), train_y) + l2 * probe.weight.pow(2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            optimizer.step(closure)
        return probe

    def accuracy(probe, x, y) -> float:
        with torch.no_grad():
            return 100.0 * (probe(x).argmax(dim=-1) == y).float().mean().item()

    probes = {l2: fit(l2) for l2 in (1e-1, 1e-2, 1e-3, 1e-4)}
    best = max(probes, key=lambda l2: accuracy(probes[l2], val_x, val_y))  # ties: the stronger L2
    metrics = {s.name: accuracy(probes[best], *image_features(clip, s.items, settings, runtime))
               for s in eval_sets if list(s.classnames) == list(split.classnames)}
    runtime.log(f"linear probe: L2 {best:g} picked on {len(val_y)} validation images; "
                + ", ".join(f"{name} {value:.2f}%" for name, value in metrics.items()))
    return metrics


@torch.no_grad()
def retrieval_check(model: dear.DeAR, job: plan.Job, settings, inputs: sources.Inputs, lists,
                    runtime: devices.Runtime) -> Optional[dict]:
    """The paper's check that an attribute token carries its attribute: the trained dataset's test
    images ranked by each feature (each attribute token that can read the image, the class
    feature, frozen CLIP) -> retrieval_<feature>.png in the run's folder. In the toy world, where
    every image's attributes are known, also precision@10 of same-value retrieval: {feature:
    {attribute: share}}, "blind" for a token that cannot read the image (None elsewhere)."""
    names = ("base", "novel", "all", job.dataset)  # the trained dataset's own test split
    own = [s for s in lists.test[job.dataset] if s.name in names]
    items = list({item.path: item for s in own for item in s.items}.values())  # each image once
    gallery = dear.analysis_images(items, RETRIEVAL_GALLERY, seed=0)
    size = inputs.clip.visual.input_resolution
    batches = devices.loader_of(gallery, settings, size, runtime)
    parts = [dear.retrieval_features(model, x.to(runtime.device)) for x, _ in batches]
    # {feature name: (M, E)}, the whole gallery
    features = {name: torch.cat([p[name] for p in parts]).cpu() for name in parts[0]}
    k = max(RETRIEVAL_K, RETRIEVAL_SHOWN)
    rankings = {name: dear.rank_gallery(f, f, k, same_images=True)
                for name, f in features.items()}  # {name: (M, k)}
    # a picture per feature that scores: no token left out of the fusion (the class-branch
    # fallback); the toy world still measures every token's precision below
    fused = {a for a, used in zip(model.attributes, model.in_fusion[1:].tolist()) if used}
    drawn = {name: r for name, r in rankings.items() if name not in model.attributes or name in fused}
    pictures.draw_retrieval(gallery, drawn, size, RETRIEVAL_QUERIES, RETRIEVAL_SHOWN, job.folder,
                        job.label)
    runtime.detail(f"[{job.label}] retrieval: {len(gallery)} test images "
                   f"ranked by {', '.join(rankings)}; pictures retrieval_*.png in {job.folder}")
    if not inputs.toy:
        return None
    from toyworld.task import split_scenes  # the toy world knows every test image's attributes

    images_dir = os.path.join(settings["root"], "toyworld", "images")
    by_path = split_scenes(settings["root"])
    paths = [os.path.relpath(item.path, images_dir).replace(os.sep, "/") for item in gallery]
    scenes = [by_path[path] for path in paths]
    values = {a: [getattr(scene, a) for scene in scenes] for a in inputs.attributes}
    return {name: {a: "blind" if name not in rankings else  # a blind token ranks nothing
                   dear.precision_at_k(rankings[name][:, :RETRIEVAL_K], values[a], values[a])
                   for a in inputs.attributes}
            for name in ["class"] + model.attributes + ["frozen CLIP"]}  # no-attribute-tokens: none
