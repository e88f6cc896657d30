"""harness/analysis.py -- the head analysis as train.py runs it (dear.analyze_heads does the
analysis itself): once per model and image pool, on images drawn evenly over the pool's classes;
its fingerprint (the weights, the pool, the descriptions, the settings, the code); the cache where
a role map is made once and reused by every run that asks for the same; the files it writes
(roles.json, roles.txt, roles.png, clusters.md; in the toy world the causal check). Called by
train.run.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import shutil
import time
from typing import Callable

import torch

import clip_model
import dear
from . import config, devices, pictures, plan, reports, runfolder, sources
from .errors import TrainError
from .devices import ANALYSIS_LOCK_TIMEOUT, MAIN_WORK_TIMEOUT, Runtime, format_time, gpu_build, wait_for_main
from .files import lock, unwritable_reason, write_json, write_text


def analysis_fingerprint(settings, clip, items: list, bank: list, attributes: list, picks: int,
                         rank: int,
                         concepts: dict, code: list) -> str:
    """SHA-256 of all a role map depends on: the weights' and BPE's SHA-256, the pool's images (path
    under --root and size: their bytes would mean reading every image), the description pool, where
    the concepts come from (the source, the encoder by its files' SHA-256 and library versions, not
    its folder's place; clustering settings, names), the analysis settings, the source of the
    code that makes and writes the map (`code`: modules and functions; changed code must not reuse
    a map), and the arithmetic it ran in (a GPU's name, torch's and cuDNN's versions; a CPU's
    vector kernels and torch's version), which may move a near tie between two picks."""
    depth = len(clip.visual.transformer.resblocks)  # vision layers
    encoder = {k: v for k, v in concepts["encoder"].items() if k not in ("model", "folder")}
    device = clip.visual.conv1.weight.device  # another device's arithmetic: another map, maybe
    arithmetic = (gpu_build(device) if device.type == "cuda" else
                  f"{device.type} ({torch.backends.cpu.get_cpu_capability()}), "
                  f"torch {torch.__version__}")
    key = dict(
        arithmetic=arithmetic,
        weights=settings["fingerprints"]["weights"], bpe=settings["fingerprints"]["bpe"],
        heads=clip.visual.transformer.heads, layers=dear.analysed_layers(depth),
        images=[[os.path.relpath(item.path, settings["root"]), os.path.getsize(item.path)]
                for item in items],
        bank=[list(entry) for entry in bank], attributes=list(attributes), picks=picks,
        rank=rank, low_bits=settings["low_bits"], high_bits=settings["high_bits"],
        concepts=dict(concepts, encoder=encoder), code=source_fingerprint(code))
    # sorted keys: one text per key
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def source_fingerprint(code: list) -> str:
    """SHA-256 of the source of each module or function in `code`, in order, each under its name."""
    parts = [f"{part.__name__}\n{inspect.getsource(part)}" for part in code]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def analysis_cache(fingerprint: str, pool: str, analyse: Callable[[str], None],
                   runtime: Runtime) -> str:
    """-> <cache>/head-analysis/<fingerprint>/, made if missing by analyse(folder) into a temporary
    folder renamed whole, under a lock: a second process waits, then reuses it."""
    root = os.path.join(clip_model.default_cache_dir(), "head-analysis")
    entry = os.path.join(root, fingerprint[:16])  # 64 bits of the SHA-256 name the folder
    if runtime.main:
        if reason := unwritable_reason(root):
            raise TrainError(f"{root}: the head-analysis cache {reason}; set $CLIP_CACHE_DIR to a "
                             "writable folder")
        os.makedirs(root, exist_ok=True)  # the lock file lives beside the entries
        if runtime.world > 1:
            bound = format_time(MAIN_WORK_TIMEOUT.total_seconds())
            runtime.log(f"head analysis: on rank 0 alone; the other processes wait for it up to "
                        f"{bound} (devices.MAIN_WORK_TIMEOUT)")
        with lock(entry + ".lock", "head analysis: another process is analysing the same "
                  f"heads ({entry}.lock); waiting for it", runtime.log,
                  timeout=ANALYSIS_LOCK_TIMEOUT.total_seconds()):
            if os.path.isfile(os.path.join(entry, "roles.json")):
                runtime.log(f"head analysis: reusing the role map cached in {entry} ({pool})")
            else:
                temporary = os.path.join(root, f".tmp-{os.getpid()}-{fingerprint[:16]}")
                # left by this pid's earlier killed call
                shutil.rmtree(temporary, ignore_errors=True)
                # roles.json, roles.txt, roles.png, analysis.json (toy: the causal check)
                analyse(temporary)
                # an entry without roles.json is incomplete
                shutil.rmtree(entry, ignore_errors=True)
                os.replace(temporary, entry)  # whole or not at all
    wait_for_main(runtime, "head analysis")  # the other processes then read what rank 0 wrote
    return entry  # its roles.json exists: complete


def analysis_pool(settings, datasets, dataset: str):
    """The images `dataset`'s analysis reads (--analysis-pool, at most --analysis-images, evenly
    over the classes) and a line naming them. 'train': the whole training split (shared with the
    test sets' read), never a few-shot draw; in base2novel its base classes only, no novel image
    before the test."""
    name, split = config.analysis_pool_of(settings["analysis_pool"])
    if name is None:
        subsample = "base" if settings["protocol"] == "base2novel" else "all"
        items = datasets.splits(dataset, subsample=subsample).train
        what = f"{dataset} train" + (" (base classes)" if subsample == "base" else "")
    else:
        items, what = getattr(datasets.splits(name), split), f"{name} {split}"
    chosen = dear.analysis_images(items, settings["analysis_images"])
    if len(chosen) < 2:  # TextSpan measures variation across images
        raise TrainError(f"--analysis-pool {settings['analysis_pool']}: {what} has "
                         f"{len(chosen)} images; the head analysis needs at least 2 "
                         "(choose another pool, e.g. imagenet:test)")
    classes = len({item.label for item in chosen})
    return chosen, f"{what}, {len(chosen)} of {len(items)} images, {classes} classes"


def run_head_analysis(settings, inputs: sources.Inputs, items: list, pool: str, picks: int, encoder: dict,
                      folder: str, runtime: devices.Runtime) -> None:
    """Concept entropy of every head of the last four layers -> roles.json, roles.txt, roles.png,
    clusters.md in `folder` (and, in the toy world, the causal check). `encoder`: the record of
    --sentence-encoder (sources.sentence_encoder_record); SBERT is loaded here, on a cache miss."""
    clip, started = inputs.clip, time.time()
    layers = dear.analysed_layers(len(clip.visual.transformer.resblocks))  # the last four
    runtime.log(f"head analysis: the last {layers} layers' heads, {picks} TextSpan picks each, "
                f"on {pool} (cached after)")
    size = clip.visual.input_resolution
    batches = (images for images, _ in devices.loader_of(items, settings, size, runtime))
    embed_texts = None  # CLIP's text tower: dear.py's own
    if encoder["name"] == "sbert":  # (labels need no encoder: read_pool refuses one)
        embed_texts = sources.sbert_embedder(encoder, runtime.device)
    role_map = dear.analyze_heads(
        clip, batches, inputs.tokenizer, inputs.bank, inputs.attributes,
        num_layers=layers, num_descriptions=picks,  # rank: the head width
        low_bits=settings["low_bits"], high_bits=settings["high_bits"],
        concepts=inputs.concepts, embed_texts=embed_texts,  # None: CLIP's text tower
        min_cluster_size=settings["min_cluster_size"], min_samples=settings["min_samples"],
        cluster_names=inputs.cluster_names, log=runtime.detail)  # its progress: the log files
    role_map.source = f"concept entropy ({inputs.concepts}) on {pool}"
    labels = sources.scoring_labels(settings["bank"], inputs.bank, sources.description_bank(inputs.toy))
    table, clusters = role_map.table(), reports.clusters_table(role_map, labels, encoder)
    runtime.log(table)
    runtime.log(reports.concepts_line(role_map))
    runtime.detail(clusters)
    pictures.draw_heatmap(role_map, os.path.join(folder, "roles.png"))
    write_text(os.path.join(folder, "roles.txt"), table + "\n")
    write_text(os.path.join(folder, "clusters.md"), clusters)
    files = "roles.json, roles.txt, roles.png, clusters.md"
    if inputs.toy:
        # Toy world only: is concept entropy right? Mean-ablate each analysed head and see which
        # attribute's zero-shot accuracy falls (the ground truth is known here). On a CPU copy of
        # the toy CLIP (1.6M parameters): the check draws on the CPU, the same table on every
        # device.
        from toyworld.causal import causal_check

        cpu_clip = clip if clip.visual.conv1.weight.is_cpu else copy.deepcopy(clip).cpu()
        result = causal_check(cpu_clip, inputs.tokenizer, role_map, role_map.attributes,
                              log=runtime.log)  # its summary, two lines
        write_text(os.path.join(folder, "causal_check.md"), result["table"] + "\n")
        write_json(os.path.join(folder, "causal_check.json"), result)
        runtime.detail(result["table"])
        files += ", causal_check.md (per head)"
    role_map.save(os.path.join(folder, "roles.json"))
    runtime.log(f"head analysis: done in {devices.format_time(time.time() - started)}; in each run "
                f"folder's <dataset>/roles/: {files}")


def analysis_code(toy: bool) -> list:
    """The code a cached role map comes from, the one list of it: its source is part of the cache
    key (analysis.analysis_fingerprint), so that a changed line never reuses a map made before. The
    method (dear.py, clip_model.py, clustering.py: the HDBSCAN dear.py calls), the harness that
    loads the encoder and writes the cached files (sources, reports, pictures, files, this
    module's run_head_analysis; the pool's words are keyed by their hash) and, in the toy
    world, the causal check written beside the map. A module the analysis comes to call is added
    here."""
    import clustering  # dear.py imports it only where it clusters

    from . import analysis, files  # this module: the pool, the cache, run_head_analysis

    code = [clip_model, dear, clustering, sources, reports, pictures, files, analysis]
    if toy:
        from toyworld import causal

        code.append(causal)
    return code


def analysed_role_maps(settings, inputs: sources.Inputs, datasets, runtime: devices.Runtime):
    """{trained dataset: its analysed RoleMap}, {trained dataset: the map's record (fingerprint,
    pool, images, picks, sha256, cache)}: a new run's from the cache (analysing what is missing);
    --resume / --eval-only read the run folder's copies, checked against settings.json."""
    maps, records, encoder = {}, {}, None
    for dataset in plan.trained_datasets(settings) if sources.analysing(settings) else []:
        if settings["resume"] or settings["eval_only"]:
            path = runfolder.role_copy(settings, dataset, checked=True)
            record = settings["role_maps"][dataset]
        else:
            started = time.time()
            items, pool = analysis_pool(settings, datasets, dataset)
            # TextSpan's rank, a head's width: 64 on ViT-B/16, 16 on the toy CLIP
            rank = dear.textspan_rank(inputs.clip)
            embed_dim = inputs.clip.visual.proj.shape[1]
            default = dear.default_picks(inputs.bank, inputs.attributes,
                                         paper=settings["analysis"] == "paper")
            picks = dear.analysis_picks(settings["descriptions"], len(inputs.bank), len(items),
                                        rank=rank, embed_dim=embed_dim, default=default)
            if encoder is None:  # once per call; a named SBERT model is found (or fetched) here
                encoder = sources.sentence_encoder_record(settings["sentence_encoder"], runtime.log)
            # (clustering settings unset: the rule's)
            concepts = dict(source=inputs.concepts, encoder=encoder, bank=settings["bank"],
                            min_cluster_size=settings["min_cluster_size"],
                            min_samples=settings["min_samples"],
                            cluster_names=inputs.cluster_names)
            fingerprint = analysis_fingerprint(settings, inputs.clip, items, inputs.bank,
                                                    inputs.attributes, picks, rank, concepts,
                                                    analysis_code(inputs.toy))
            took = time.time() - started
            runtime.detail(f"head analysis: pool {pool}, chosen and fingerprinted in {took:.1f} s")
            record = dict(fingerprint=fingerprint, pool=pool, images=len(items), picks=picks,
                          concepts=concepts)

            def analyse(folder: str) -> None:
                run_head_analysis(settings, inputs, items, pool, picks, encoder, folder, runtime)
                write_json(os.path.join(folder, "analysis.json"), record)

            entry = analysis_cache(fingerprint, pool, analyse, runtime)
            path = os.path.join(entry, "roles.json")
            record.update(sha256=sources.sha256(path), cache=entry)
        maps[dataset], records[dataset] = sources.load_role_file(path), record
        record.setdefault("class_branch_only", dear.falls_back_to_class_branch(maps[dataset]))
        if record["class_branch_only"]:
            runtime.log(f"head analysis ({dataset}): no attribute head; "
                        "DeAR falls back to the class branch alone")
    return maps, records
