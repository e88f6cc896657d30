"""dear.py -- DeAR (Ma et al., "Fine-Grained VLM Adaptation by Decomposing Attention Head Roles",
CVPR 2026) in the order it runs: 1. TextSpan, and the records the rest takes; 2. concepts (the
picks clustered, or their labels); 3. concept entropy's head roles (paper Sec. 3.2; analyze_heads
runs 1-3); 4. the role-based mask (paper Sec. 3.3); 5. the model (DeAR, SeparateTokens); 6. the
losses (paper Sec. 3.4). After the method: 7. the paper's ablations (ablate); 8. at test time,
which logits score a test set, and retrieval; 9. MMRL++'s token construction (tokens="shared");
10. bookkeeping: the argument checks (one table), RoleMap with its checks, JSON file and table.
"paper Sec. N" is the paper's, "METHOD.md Sec. N" docs/METHOD.md's, which has our choices where
the paper is silent. The project's description bank is data (harness/bank.py).

The method unbatched: tests/test_dear_reference.py writes DeAR's forward pass out one head at a
time; this file batches it. It imports torch and clip_model.py: copy the two files together.
Clustering the picks (concepts="clusters") also needs clustering.py (HDBSCAN written out; torch
and numpy) beside them; everything else runs without it. `first_layer` is the paper's 1-based
J; what is stored (`HeadRole.layer`) is 0-based.

Shapes, the project's letters: B images in a batch; C classes; N tokens of a sequence (an image:
1 + G*G, the class token and the patches; a text: its length); G the patch grid's side; R the image
resolution; W the width of a tower's residual stream (W_v vision, W_t text; W_z the latent tokens'
under tokens="shared"); H heads; D a head's width; E the joint embedding's width; L_v and L_t the
vision and the text tower's layers from J on; L_a the analysed layers (the vision tower's last
four); A attribute tokens; K learnable text tokens; Q a low-rank term's rank (tokens="shared");
n images of the analysis; T descriptions in the bank; P distinct picks; d an encoder's width
(clustering's points are the P picks). Einsum strings use the same letters in lower case.

Try it on a random small CLIP:  python dear.py
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import (Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # in a package (myproj/vendor/) only the relative import works, at the top level the other
    from . import clip_model
except ImportError:
    import clip_model

CORE_ATTRIBUTES = ("colour", "shape", "texture", "object", "location")  # the paper's five tokens
ROLES = ("attribute", "generalization", "mixed")
CONCEPT_SOURCES = ("clusters", "labels")  # the paper's: the picks clustered; the control: labels
PAPER_PICKS = 20  # TextSpan's picks per head, the paper's "N" (default_picks: unlabelled pools)
ANALYSED_LAYERS = 4  # the paper analyses, and prompts, the vision tower's last four layers
ANALYSIS_SEED = 0  # analysis_images' draw: fixed, so every run of a model reads the same images
# MMRL's class-branch weight, in its loss and in its fixed logits_fusion (yunncheng/MMRL
# trainers/mmrl.py, MMRL_Loss and CustomCLIP.forward; train.py: TRAINER.MMRL.ALPHA)
MMRL_ALPHA = 0.7
FUSE = ("logits", "features")  # what alpha weighs: branch logits (ours), or features (METHOD.md 5)
TOKEN_CONSTRUCTIONS = ("separate", "shared")  # each layer's own tokens (ours), or MMRL++'s space
TEXT_TOKENS = 4  # K under tokens="separate" (our choice); "shared": K = A (default_text_tokens)
# tokens="shared", MMRL++'s ranks (yunncheng/MMRL configs/trainers/MMRLpp/vit_b16.yaml):
SHARED_RESIDUAL_RANK = 4  # each token layer's residual on its tower's map (RES_LORA_DIM)
SHARED_PROJ_RANK = 64  # the attribute projection's learnable residual on proj (PROJ_LORA_DIM)


class DeARError(ValueError):
    """Bad input (a role file, an attribute name, J, beta): one line naming it and what to do."""


class LeftOutWarning(UserWarning):
    """Attribute branches leave the fusion (blind tokens, or the fallback to the class branch): a
    caller that has said so already silences this category, whatever the words."""


# ---- 1. TextSpan: which descriptions explain a head (paper Sec. 3.2, METHOD.md Sec. 3) ----------
# TextSpan names what a head writes into the image embeddings (clip_model.head_contributions): from
# a bank it picks, one at a time, the text along which the head varies most, then projects it out.
def textspan(contributions: torch.Tensor, text_embeddings: torch.Tensor,
             num_descriptions: int, rank: int) -> List[int]:
    """TextSpan (Gandelsman et al., ICLR 2024, Alg. 1), picking what its authors' code picks, in
    order. contributions (n, E), one head's direct contributions to the image embeddings; the bank
    (T, E); rank: textspan_rank(clip) -> indices into the bank."""
    return [pick for pick, _ in textspan_steps(contributions, text_embeddings, num_descriptions,
                                               rank)]


def textspan_steps(contributions: torch.Tensor, text_embeddings: torch.Tensor,
                   num_descriptions: int, rank: int) -> Iterator[Tuple[int, float]]:
    """textspan one pick at a time -> (bank index, the share of the head's variance across the
    images that removing the pick's direction takes away). The shares add up to at most 1."""
    analysis_picks(num_descriptions, len(text_embeddings), len(contributions), rank=rank,
                   default=num_descriptions, embed_dim=contributions.shape[1])  # 1..min(T, n, r, E)
    data = contributions.double()
    # The head's span from the raw contributions, not centred (the authors' order): the mean all
    # images share is a direction the head writes too. Centring first (rank n - 1) would pick
    # otherwise: in 16 of tests/test_textspan.py's 18 inputs (METHOD.md Sec. 3).
    _, _, right = torch.linalg.svd(data, full_matrices=False)  # right: (min(n, E), E)
    span = right[:rank]  # (r, E), r = min(rank, n, E): the authors' vh[:rank]
    bank = text_embeddings.double() @ span.T @ span  # (T, E): each text inside the head's span
    data = data - data.mean(dim=0, keepdim=True)  # (n, E): centred now, for the spread only
    total = data.pow(2).sum().clamp_min(1e-300)  # the head's variance across images, times n - 1
    chosen: List[int] = []
    for _ in range(num_descriptions):
        spread = (data @ bank.T).std(dim=0)  # (T,): how much each text direction varies
        spread[chosen] = -1.0  # removed texts spread 0; -1 keeps them out of a tie at 0 too
        best = int(spread.argmax())
        chosen.append(best)
        direction = bank[best] / bank[best].norm().clamp_min(1e-12)  # (E,), as the authors'
        along = data @ direction  # (n,): each image's contribution along the pick
        yield best, float(along.pow(2).sum() / total)
        data = data - along[:, None] * direction[None]  # remove it from the head ...
        bank = bank - (bank @ direction)[:, None] * direction[None]  # ... and from the bank


def textspan_rank(clip: clip_model.CLIP) -> int:
    """TextSpan's r, the one default of it: a head's OV rank, its width D (64 on ViT-B/16). The
    authors' --w_ov_rank 80 ("the rank of the OV matrix") is ViT-H/14's head width."""
    return clip.visual.transformer.resblocks[0].attn.head_dim


def default_picks(bank: Sequence[Description], attributes: Sequence[str],
                  paper: bool = False) -> int:
    """TextSpan's N, the picks per head: the one default of it (our rule; METHOD.md Sec. 3). A
    labelled bank: the fewest values of a core attribute, as a pure specialist has nothing left to
    explain once its values are picked (the toy bank's 4, the project's 16). Without labels, or
    paper=True: the paper's 20."""
    bank = [Description(*entry) for entry in bank]
    if paper or any(entry.concept is None for entry in bank):
        return PAPER_PICKS
    values = {}  # attribute -> its distinct values (a phrase without a value word: its text)
    for text, concept, value in bank:
        if concept in attributes:
            values.setdefault(concept, set()).add(text if value is None else value)
    if not values:
        raise DeARError(f"the bank has no phrase of any attribute ({', '.join(attributes)}); "
                        "label phrases with them")
    return min(len(v) for v in values.values())


# ---- The records the method passes around (RoleMap, the role of every head: section 10) ---------
class Description(NamedTuple):
    """One phrase of a description pool (METHOD.md Sec. 3), for TextSpan to choose from: its concept
    when the pool is labelled (None: clusters find it), its value word ("red") when known."""
    text: str
    concept: Optional[str] = None
    value: Optional[str] = None


@dataclass
class Cluster:
    """One discovered concept: a cluster of distinct picked descriptions."""
    id: int  # HDBSCAN's cluster id, as printed in clusters.md (and used by a names override)
    name: str  # the core attribute it stands for, or "other"
    size: int  # distinct picks in it
    central: List[str]  # its most central phrases (nearest its mean), at most CENTRAL_SHOWN


@dataclass
class HeadRole:
    """One analysed head: its role, and what the analysis saw of it."""
    layer: int  # 0-based layer index (the paper's layer number is layer + 1)
    head: int  # 0-based head index
    role: str  # "attribute" | "generalization" | "mixed"
    attribute: Optional[str] = None  # for attribute heads: which core attribute
    entropy: Optional[float] = None  # concept entropy in bits (None when not analysed)
    descriptions: List[str] = field(default_factory=list)  # TextSpan's picks, in order
    concepts: List[str] = field(default_factory=list)  # each pick's: a label, "cluster k", NOISE


# ---- 2. Concepts: the heads' picks clustered, or their labels (paper Sec. 3.2, METHOD.md Sec. 3) -
# The paper labels no description: every analysed head's picks are embedded by a sentence encoder
# (SBERT in the paper; CLIP's text tower by default here, our choice), clustered with HDBSCAN
# (clustering.py), each cluster a concept; concepts="labels" (the toy's control) takes the labels.
NOISE = "noise"  # the concept of a pick that HDBSCAN leaves in no cluster
CENTRAL_SHOWN = 5  # phrases shown per cluster (its most central ones)


def default_concepts(bank: Sequence[Description]) -> str:
    """The concept source unless asked (our choice, METHOD.md Sec. 3): a labelled bank's labels,
    which name the toy CLIP's heads better than its clusters do; else clusters, the paper's."""
    labelled = all(Description(*entry).concept is not None for entry in bank)
    return "labels" if labelled else "clusters"


def default_min_cluster_size(num_picks: int) -> int:
    """HDBSCAN's smallest cluster (our choice, METHOD.md Sec. 3): as many phrases as one head picks,
    so that a concept is at least what fills one specialist's picks, never a value's few phrases."""
    return max(2, num_picks)


def cluster_picks(texts: Sequence[str], embeddings: torch.Tensor, min_cluster_size: int,
                  min_samples: Optional[int] = None):
    """Distinct picked texts (P,) and their embeddings (P, d) -> (each text's concept, "cluster k"
    or NOISE; the clusters, named "other" until named; their unit means (clusters, d))."""
    points = F.normalize(embeddings.double(), dim=-1)  # (P, d), unit: Euclidean order = cosine's
    ids = hdbscan(points, min_cluster_size, min_samples)  # (P,), -1 = noise (section 10)
    clusters, centres = [], []
    for k in range(int(ids.max()) + 1 if len(ids) else 0):
        members = (ids == k).nonzero().flatten()  # (m,), the cluster's m picks
        centres.append(F.normalize(points[members].mean(dim=0), dim=0))  # (d,)
        nearest = (points[members] @ centres[-1]).argsort(descending=True)[:CENTRAL_SHOWN]
        central = [texts[members[i]] for i in nearest.tolist()]
        clusters.append(Cluster(k, "other", len(members), central))
    found = [f"cluster {k}" if k >= 0 else NOISE for k in ids.tolist()]
    return found, clusters, torch.stack(centres) if centres else points[:0]


def name_by_labels(found: Sequence[str], labels: Sequence[str],
                   attributes: Sequence[str]) -> Dict[str, str]:
    """A labelled pool: each cluster is named by its phrases' most common label when that is a core
    attribute, else "other" (the labels name the concepts; which picks go together stays HDBSCAN's).
    found: each distinct pick's concept, as cluster_picks gives it; labels: each one's label."""
    counts: Dict[str, Counter] = {}  # cluster -> its phrases' labels, counted in one pass
    for concept, label in zip(found, labels):
        if concept != NOISE:
            counts.setdefault(concept, Counter())[label] += 1
    names = {concept: c.most_common(1)[0][0] for concept, c in counts.items()}
    return {concept: name if name in attributes else "other" for concept, name in names.items()}


def name_by_anchors(centres: torch.Tensor, anchors: torch.Tensor,
                    attributes: Sequence[str]) -> Dict[str, str]:
    """A pool without labels: cluster means (clusters, d) and the attributes' names embedded (A, d)
    -> each attribute names the cluster nearest it if it is that cluster's nearest attribute too
    (mutual nearest by cosine; our choice): at most one cluster per attribute."""
    similarity = F.normalize(centres.double(), dim=-1) @ F.normalize(anchors.double(), dim=-1).T
    names = {f"cluster {k}": "other" for k in range(len(centres))}  # similarity: (clusters, A)
    for a, attribute in enumerate(attributes):
        k = int(similarity[:, a].argmax()) if len(centres) else -1
        if k >= 0 and int(similarity[k].argmax()) == a:
            names[f"cluster {k}"] = attribute
    return names


class Concepts(NamedTuple):
    """The picks' concepts, from one source (find_concepts): what concept entropy and roles read."""
    of: List[str]  # each distinct pick's concept: its label, "cluster k" or NOISE
    names: Dict[str, str]  # each concept's name: a core attribute, or not (a label: itself)
    count: int  # K, the concepts a pick can fall on: the labels; or the clusters + picks in none
    clusters: List[Cluster]  # the clusters found, named (none for labels)


def find_concepts(source: str, bank: Sequence[Description], picked: Sequence[int],
                  attributes: Sequence[str], embed: Callable[[List[str]], torch.Tensor],
                  min_cluster_size: int, min_samples: Optional[int] = None,
                  cluster_names: Optional[Dict[int, str]] = None,
                  log: Callable[[str], None] = print) -> Concepts:
    """The concepts of the distinct picks (picked: (P,) bank indices). "labels": each pick's label,
    named by itself, K = the bank's distinct labels. "clusters": HDBSCAN over the picks, embedded
    by embed (texts -> (P, d)), named by name_by_labels in a labelled bank, else name_by_anchors;
    cluster_names ({id: name}) overrides any; K = clusters + picks in none (each its own)."""
    if source == "labels":
        labels = {entry.concept for entry in bank}
        return Concepts([bank[i].concept for i in picked], {c: c for c in labels}, len(labels), [])
    texts = [bank[i].text for i in picked]
    found, clusters, centres = cluster_picks(texts, embed(texts), min_cluster_size, min_samples)
    if all(bank[i].concept is not None for i in picked):  # all labelled: the labels name them
        names = name_by_labels(found, [bank[i].concept for i in picked], attributes)
    else:  # without labels: the attributes' own names, in the same encoder's space
        names = name_by_anchors(centres, embed(list(attributes)), attributes)  # anchors (A, d)
    names.update({f"cluster {k}": name for k, name in (cluster_names or {}).items()})  # the user's
    names[NOISE] = NOISE
    for cluster in clusters:
        cluster.name = names[f"cluster {cluster.id}"]
    log(clusters_line(found, clusters, min_cluster_size))  # section 10
    return Concepts(found, names, len(clusters) + found.count(NOISE), clusters)


# ---- 3. Roles: entropy -> attribute / generalization / mixed (paper Sec. 3.2, METHOD.md Sec. 3) --
# A head whose picks fall on one concept is a specialist (low entropy), one whose picks spread is
# general (high entropy; assign_roles). analyze_heads, at this section's end, runs sections 1-3.
def concept_entropy(pick_concepts: Sequence[str]) -> float:
    """Paper Eq. 2: H = -sum_c P(c) log2 P(c), P(c) the share of a head's picks about concept c:
    0 bits for a specialist. A pick in no cluster (NOISE) is a concept of its own (our choice,
    METHOD.md Sec. 3): TextSpan found that it explains the head and it resembles no other pick."""
    counts = list(Counter(c for c in pick_concepts if c != NOISE).values())
    counts += [1] * list(pick_concepts).count(NOISE)
    total = len(pick_concepts)
    return float(-sum((c / total) * math.log2(c / total) for c in counts))


def dominant_concept(pick_concepts: Sequence[str]) -> str:
    """The most frequent concept, never NOISE while a cluster is there; a tie goes to the one
    TextSpan found first (it explains more)."""
    counts = Counter(c for c in pick_concepts if c != NOISE)
    if not counts:
        return NOISE
    return next((c for c in pick_concepts if counts.get(c) == max(counts.values())), NOISE)


def default_thresholds(num_picks: int, num_concepts: int):
    """(low_bits, high_bits), our rule (METHOD.md Sec. 3), in absolute bits: thirds of the
    entropies that the picks of one head can take over these concepts. The toy: N = 4 picks over
    K = 7 concepts, at most log2(4) = 2 bits: 0.81 (the floor) and 1.33 bits. The project's bank:
    N = 16, K = 12 -> thirds of log2(12) = 3.58 bits, 1.19 and 2.39, the floor unused."""
    top = math.log2(max(1, min(num_picks, num_concepts)))  # the most bits: picks spread evenly
    low, high = top / 3, 2 * top / 3  # under a third: specialised; over two thirds: spread
    # The floor: 3 of every 4 picks on one concept (0.81 bits) still make a specialist; it lifts low
    # where min(picks, concepts) is 3, 4 or 5. At 2, high itself is 0.67: there is no floor.
    floor = concept_entropy(["a", "a", "a", "b"])  # 0.81 bits
    if floor < high:  # min(picks, concepts) >= 3
        low = max(low, floor)
    return low, high


def assign_roles(entropies: Sequence[float], dominants: Sequence[str],
                 attributes: Sequence[str], low_bits: float, high_bits: float):
    """Heads -> [(role, attribute or None)]: each head's entropy and its dominant concept's name.
    H <= low: an attribute head for that concept if it is a core attribute, else (e.g. "style":
    no token) generalization; H >= high: generalization; between: mixed."""
    check(low_bits=low_bits, high_bits=high_bits)  # section 10
    roles = []
    for entropy, dominant in zip(entropies, dominants):
        if entropy <= low_bits and dominant in attributes:
            roles.append(("attribute", dominant))
        elif entropy <= low_bits or entropy >= high_bits:  # a specialist with no token, or spread
            roles.append(("generalization", None))
        else:
            roles.append(("mixed", None))
    return roles


def analysed_layers(depth: int) -> int:
    """L_a: how many of a `depth`-layer vision tower's last layers the head analysis reads."""
    return min(ANALYSED_LAYERS, depth)


def analysis_images(items: Sequence, cap: int, seed: int = ANALYSIS_SEED) -> list:
    """Which images the head analysis reads (our choice; the paper's are ImageNet's validation
    images): of `items` (each with a .label), at most `cap`, one per class in turn, each class's and
    the classes in a seeded order: never a label-sorted list's first classes alone."""
    generator = torch.Generator().manual_seed(seed)
    by_class = {}
    for item in items:
        by_class.setdefault(item.label, []).append(item)
    groups = [group for _, group in sorted(by_class.items())]
    orders = [torch.randperm(len(group), generator=generator) for group in groups]
    longest = max(map(len, groups), default=0)
    rounds, taken = 0, 0
    while taken < cap and rounds < longest:  # rounds of one image per class that reach the cap
        taken += sum(len(group) > rounds for group in groups)
        rounds += 1
    # Only those rounds' images are looked up (ImageNet: 2 of each class's ~1,281), round by round.
    queues = [[group[i] for i in order[:rounds].tolist()] for group, order in zip(groups, orders)]
    queues = [queues[i] for i in torch.randperm(len(queues), generator=generator).tolist()]
    return [queue[depth] for depth in range(rounds) for queue in queues if depth < len(queue)][:cap]


@torch.no_grad()
def encode_descriptions(clip: clip_model.CLIP, tokenizer: clip_model.SimpleTokenizer,
                        texts: Sequence[str]) -> torch.Tensor:
    """Texts -> (T, E) normalised CLIP text embeddings, 256 texts a batch."""
    device = clip.positional_embedding.device
    batches = (tokenizer.tokenize(texts[s:s + 256], clip.context_length, truncate=True)
               for s in range(0, len(texts), 256))
    return torch.cat([F.normalize(clip.encode_text(b.to(device)), dim=-1) for b in batches])


def normalised_contributions(clip: clip_model.CLIP, image_batches, num_layers: int,
                             log: Callable[[str], None]) -> torch.Tensor:
    """Head contributions over each image embedding's norm (as TextSpan does): (n, L_a, H, E)."""
    per_image = []
    device = clip.visual.conv1.weight.device
    batches = image_batches.split(64) if isinstance(image_batches, torch.Tensor) else image_batches
    for batch in batches:
        check(image_batch=batch)  # section 10
        parts = clip_model.head_contributions(clip, batch.to(device), num_layers)
        norms = parts.total().norm(dim=-1)[:, None, None, None]  # (B, 1, 1, 1)
        per_image.append((parts.heads / norms).cpu())  # (B, L_a, H, E)
        log(f"  head analysis: contributions of {sum(len(p) for p in per_image)} images")
    if not per_image:
        raise DeARError("image_batches holds no images; the analysis needs at least 2")
    return torch.cat(per_image)


@torch.no_grad()
def analyze_heads(clip: clip_model.CLIP, image_batches: Union[torch.Tensor, Iterable[torch.Tensor]],
                  tokenizer: clip_model.SimpleTokenizer, bank: Sequence[Description],
                  attributes: Sequence[str] = CORE_ATTRIBUTES, num_layers: Optional[int] = None,
                  num_descriptions: Optional[int] = None, rank: Optional[int] = None,
                  low_bits: Optional[float] = None, high_bits: Optional[float] = None,
                  concepts: Optional[str] = None,
                  embed_texts: Optional[Callable[[List[str]], torch.Tensor]] = None,
                  min_cluster_size: Optional[int] = None, min_samples: Optional[int] = None,
                  cluster_names: Optional[Dict[int, str]] = None,
                  log: Callable[[str], None] = print) -> RoleMap:
    """The head analysis (paper Sec. 3.2) -> RoleMap. image_batches: (n, 3, R, R) or an iterable of
    (B, 3, R, R); bank: the descriptions TextSpan picks from (Description, or (text, concept,
    value) triples; the project's: harness/bank.py). For each head of the last L_a = num_layers
    layers: TextSpan's picks; then the concepts (find_concepts; "clusters": the picks embedded by
    embed_texts, default CLIP's text tower; "labels": the bank's), each head's concept entropy and
    role. A None takes its default_* (analysed_layers, textspan_rank, default_picks, ...)."""
    bank = [Description(*entry) for entry in bank]  # (text, concept, value) triples also do
    source = default_concepts(bank) if concepts is None else concepts  # "clusters" or "labels"
    check(concepts=source, bank=bank)  # section 10
    depth = len(clip.visual.transformer.resblocks)
    rank = textspan_rank(clip) if rank is None else rank
    if num_layers is None:  # else head_contributions checks it
        num_layers = analysed_layers(depth)

    # 1. Each head's direct contributions, and TextSpan's picks from the bank.
    contributions = normalised_contributions(clip, image_batches, num_layers, log)  # (n, L_a, H, E)
    n, L_a, H, E = contributions.shape
    default = default_picks(bank, attributes) if num_descriptions is None else num_descriptions
    num_descriptions = analysis_picks(num_descriptions, len(bank), n, rank=rank,  # before encoding
                                      default=default, embed_dim=E)
    bank_embeddings = encode_descriptions(clip, tokenizer, [d.text for d in bank]).cpu()  # (T, E)
    log(f"  head analysis: {len(bank)} descriptions; TextSpan with rank {min(rank, n, E)} and "
        f"{num_descriptions} picks per head")
    first = depth - num_layers
    picks = []  # per head (layer-major), the bank indices TextSpan chose
    for li in range(L_a):
        for head in range(H):
            picks.append(textspan(contributions[:, li, head], bank_embeddings, num_descriptions,
                                  rank))
        log(f"  head analysis: layer {first + li + 1} (index {first + li}) done")

    # 2. The concepts of the distinct picks (a phrase picked by several heads counts once).
    picked = list(dict.fromkeys(i for head_picks in picks for i in head_picks))  # (P,), in order
    known = {entry.text: row for entry, row in zip(bank, bank_embeddings)}  # CLIP's, made above

    def embed(texts: List[str]) -> torch.Tensor:  # texts -> (len(texts), d)
        if embed_texts is not None:  # the user's encoder, checked
            return checked_embeddings(embed_texts, texts)
        if all(text in known for text in texts):  # the picks, bank phrases: encoded above
            return torch.stack([known[text] for text in texts])
        return encode_descriptions(clip, tokenizer, texts).cpu()  # name_by_anchors' names

    if min_cluster_size is None:
        min_cluster_size = default_min_cluster_size(num_descriptions)
    found = find_concepts(source, bank, picked, attributes, embed, min_cluster_size, min_samples,
                          cluster_names, log)
    concept_of = dict(zip(picked, found.of))

    # 3. Each head's concept entropy and dominant concept's name, then its role.
    default_low, default_high = default_thresholds(num_descriptions, found.count)
    low = default_low if low_bits is None else low_bits
    high = default_high if high_bits is None else high_bits
    head_concepts = [[concept_of[i] for i in head_picks] for head_picks in picks]
    entropies = [concept_entropy(c) for c in head_concepts]
    # each head's most frequent concept, by its name ("cluster 3" -> "colour", say; a label: itself)
    dominants = [found.names[dominant_concept(c)] for c in head_concepts]
    roles = assign_roles(entropies, dominants, attributes, low, high)
    heads = [HeadRole(first + k // H, k % H, role, attribute, entropies[k],
                      [bank[i].text for i in picks[k]], head_concepts[k])
             for k, (role, attribute) in enumerate(roles)]
    return RoleMap(depth, H, list(attributes), heads, low, high, concepts=source,
                   clusters=found.clusters)


# ---- 4. The role-based attention mask (paper Sec. 3.3, METHOD.md Sec. 4) -------------------------
# Tokens from layer J on: [the image's N tokens (CLS and patches), A attribute tokens]. Each head
# has its own additive mask (0 = may attend, -inf = may not):
#   generalization head: image and attribute tokens never see each other; each attribute token sees
#                        only itself (within the layer: earlier heads wrote into what it reads).
#   attribute head (a):  attribute token a and the image tokens see each other; the other
#                        attribute tokens see only themselves.
#   mixed head:          no restriction.
# Every row keeps a 0 (a token always sees itself), so no softmax is over nothing.
def head_mask(role: str, attribute_index: Optional[int], num_image_tokens: int,
              num_attribute_tokens: int) -> torch.Tensor:
    """One head's mask, (N + A, N + A) with N image tokens and A attribute tokens; row = query."""
    N, size = num_image_tokens, num_image_tokens + num_attribute_tokens
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:N, :N] = True  # the image's own tokens always see each other, as in CLIP
    allowed[torch.arange(N, size), torch.arange(N, size)] = True  # each attribute token sees itself
    if role == "mixed":
        allowed[:] = True
    elif role == "attribute":
        a = N + attribute_index
        allowed[:N, a] = True  # image tokens read attribute token a ...
        allowed[a, :N] = True  # ... and token a reads the image
    elif role != "generalization":
        raise DeARError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))


def build_role_masks(role_map: RoleMap, first_layer: int, depth: int,
                     num_image_tokens: int) -> torch.Tensor:
    """(L_v, H, N + A, N + A), L_v = depth - J + 1 the layers from J on of a `depth`-layer vision
    tower (J 1-based); a layer the map does not cover has mixed heads (no mask)."""
    A, size = len(role_map.attributes), num_image_tokens + len(role_map.attributes)
    masks = torch.zeros(depth - first_layer + 1, role_map.num_heads, size, size)
    for i, layer in enumerate(range(first_layer - 1, depth)):
        for head in range(role_map.num_heads):
            entry = role_map.role_of(layer, head) or HeadRole(layer, head, "mixed")
            a = role_map.attributes.index(entry.attribute) if entry.role == "attribute" else None
            masks[i, head] = head_mask(entry.role, a, num_image_tokens, A)
    return masks


def blind_attributes(role_masks: torch.Tensor, num_image_tokens: int,
                     attributes: Sequence[str]) -> List[str]:
    """The attributes whose token no head from J on (no attribute head for it, no mixed head) lets
    read the image: a per-class bias, so DeAR leaves its branch out of the fusion."""
    N = num_image_tokens
    reads_image = torch.isfinite(role_masks[:, :, N:, :N]).any(dim=-1)  # (L_v, H, A)
    readable = reads_image.any(dim=0).any(dim=0)  # (A,)
    return [a for a, can_read in zip(attributes, readable) if not can_read]


# ---- 5. The model (paper Sec. 3.3-3.4, METHOD.md Sec. 4) -----------------------------------------
# DeAR is frozen CLIP plus learnable tokens from layer J on: in the vision tower A attribute tokens
# follow the image's N tokens, each head under its role mask (section 4); in the text tower K tokens
# follow the start token. DeAR.forward fuses the branches' logits (paper Eq. 6-7).
def default_first_layer(depth: int) -> int:
    """The paper's J (1-based), the one default of it: the first analysed layer (9 of 12 for
    ViT-B/16); train.py's --first-layer auto is this."""
    return depth - analysed_layers(depth) + 1


def falls_back_to_class_branch(role_map: RoleMap) -> bool:
    """A measured map (a hand-made one is taken as given) without attribute heads (our choice,
    METHOD.md Sec. 3)."""
    measured = any(h.entropy is not None for h in role_map.heads)
    return measured and not any(h.role == "attribute" for h in role_map.heads)


def initial_fusion_logits(cls_fusion_weight: float, num_attributes: int) -> torch.Tensor:
    """(1 + A,): alpha_cls = cls_fusion_weight at the start, the rest shared evenly."""
    rest = (1 - cls_fusion_weight) / max(num_attributes, 1)
    return torch.tensor([math.log(cls_fusion_weight)] + [math.log(rest)] * num_attributes)


def branches_in_fusion(attributes: List[str], blind: List[str], class_branch_only: bool,
                       first_layer: int) -> torch.Tensor:
    """(1 + A,) bool: the class branch, and the attribute branches that can read the image (none on
    the fallback to the class branch, our choice: METHOD.md Sec. 3); warns of what is left out."""
    if class_branch_only:
        warnings.warn("DeAR: the head analysis names no attribute head (no head is specialised "
                      "enough); falling back to the class branch alone "
                      "(the attribute branches leave the fusion)", LeftOutWarning)
    elif blind:
        plural = "s" if len(blind) > 1 else ""
        warnings.warn(f"DeAR: no head from layer J={first_layer} lets the {', '.join(blind)} "
                      f"token{plural} read the image; left out of the fusion (a per-class bias)",
                      LeftOutWarning)
    left_out = attributes if class_branch_only else blind
    return torch.tensor([True] + [a not in left_out for a in attributes])


# The token construction (METHOD.md Sec. 4), where each layer's fresh tokens p_l come from:
# SeparateTokens (the default) or SharedTokens (MMRL++'s, section 9), which DeAR reads the same way.
def default_text_tokens(tokens: str, num_attributes: int) -> int:
    """K, the one rule of it: 4 under "separate" (our choice); K = A under "shared", whose text
    tower receives the vision tower's latent tokens (MMRL++). A = 0 (ablate's no-attribute-tokens)
    keeps the full row's K, which "shared" must be given (num_text_tokens, as train.py does)."""
    return TEXT_TOKENS if tokens == "separate" else num_attributes


class SeparateTokens(nn.Module):
    """tokens="separate" (the default, our choice): each layer from J and each tower its own tokens
    in that tower's width (normal, std 0.02), and the attribute tokens' own projection, a learnable
    copy of proj. vision: (L_v, A, W_v), text: (L_t, K, W_t), proj: CLIP's (W_v, E)."""

    def __init__(self, *, vision: Sequence[int], text: Sequence[int], proj: torch.Tensor):
        super().__init__()
        self.vision_tokens = nn.Parameter(torch.randn(*vision) * 0.02)  # (L_v, A, W_v)
        self.text_tokens = nn.Parameter(torch.randn(*text) * 0.02)  # (L_t, K, W_t)
        self.attribute_proj = nn.Parameter(proj.detach().clone())  # (W_v, E), starts as proj

    def vision_layer_tokens(self) -> torch.Tensor:  # p_l of each vision layer from J: (L_v, A, W_v)
        return self.vision_tokens

    def text_layer_tokens(self) -> torch.Tensor:  # p_l of each text layer from J: (L_t, K, W_t)
        return self.text_tokens

    def attribute_projection(self, proj: torch.Tensor) -> torch.Tensor:
        """(W_v, E), learned; CLIP's proj is read by SharedTokens' alone (DeAR calls both alike)."""
        return self.attribute_proj


def cosine_logits(features: torch.Tensor, text_features: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    """(..., E) image features, (C, E) text features -> s * cos, (..., C), in fp32 with autocast
    off, whatever the encoders ran in: in bf16 a logit between 16 and 32 moves in steps of 0.125
    and two close classes swap (METHOD.md Sec. 5)."""
    with torch.autocast(features.device.type, enabled=False):
        image = F.normalize(features.float(), dim=-1)  # (..., E)
        text = F.normalize(text_features.float(), dim=-1)  # (C, E)
        return scale.float() * image @ text.T  # (..., C)


class PreparedClasses(NamedTuple):
    """One class list's frozen text side up to layer J (`DeAR.prepare_classes`)."""
    hidden: torch.Tensor  # (C, N, W_t) the prompts' states entering text layer J (0-based J - 1)
    eot: torch.Tensor  # (C,) each prompt's end-of-text position (before the K tokens go in)
    frozen: torch.Tensor  # (C, E) plain CLIP's text features (for L_reg)


@dataclass
class DeAROutput:
    logits: torch.Tensor  # (B, C) fused: sum_k alpha_k * branch_logits[:, k]
    branch_logits: torch.Tensor  # (B, 1 + A, C): the class branch first, then one per attribute
    alpha: torch.Tensor  # (1 + A,) fusion weights, softmax of the learnable fusion_logits
    image_features: torch.Tensor  # (B, 1 + A, E) [f_cls, f_attr_1, ...], not normalised
    text_features: torch.Tensor  # (C, E) t_c, shared by every branch
    frozen_image_features: Optional[torch.Tensor] = None  # (B, E) plain CLIP (for L_reg)
    frozen_text_features: Optional[torch.Tensor] = None  # (C, E) plain CLIP (for L_reg)
    fused_attributes: Optional[List[int]] = None  # the attribute branches in the fusion (1..A)


class DeAR(nn.Module):
    """Frozen CLIP (in place, no copy) + learnable tokens from layer J on (paper Sec. 3.3-3.4); by
    default the map's attributes, J the first analysed layer, K default_text_tokens. Learnable:
      tokens         SeparateTokens (tokens="separate", the default) or SharedTokens ("shared"):
                     each layer's vision tokens, text tokens and the attribute projection
      fusion_logits  (1 + A,): alpha = softmax over the class branch and those reading the image
    beta = 0.5 is the library's choice for a small model; train.py passes the recipe's (MMRL++'s
    0.9 and its per-dataset values, METHOD.md Sec. 7). class_branch_fallback=False keeps every
    branch of a measured map without attribute heads, one made so on purpose (ablate's
    mask-generalization-only). Without attribute tokens (A = 0): frozen CLIP's image feature, the
    text tokens, alpha = (1,). fuse: what alpha weighs, each branch's logits (the default) or its
    feature (fused_logits); fixed_alpha: alpha_cls held there, the rest even, not learned."""

    def __init__(self, clip: clip_model.CLIP, role_map: RoleMap,
                 attributes: Optional[Sequence[str]] = None, first_layer: Optional[int] = None,
                 beta: float = 0.5, num_text_tokens: Optional[int] = None,
                 cls_fusion_weight: float = 0.5, tokens: str = "separate",
                 latent_width: Optional[int] = None, class_branch_fallback: bool = True,
                 fuse: str = "logits", fixed_alpha: Optional[float] = None):
        super().__init__()
        if fuse not in FUSE:
            raise DeARError(f"fuse={fuse!r}: use {' or '.join(FUSE)}")
        depth = len(clip.visual.transformer.resblocks)
        attributes = list(role_map.attributes if attributes is None else attributes)
        first_layer = default_first_layer(depth) if first_layer is None else first_layer
        check(first_layer=first_layer, depth=min(depth, len(clip.transformer.resblocks)), beta=beta,
              tokens=tokens, num_attributes=len(attributes), num_text_tokens=num_text_tokens,
              latent_width=latent_width, cls_fusion_weight=cls_fusion_weight)  # section 10
        role_map.validate(depth, clip.visual.transformer.heads, attributes)
        if num_text_tokens is None:
            num_text_tokens = default_text_tokens(tokens, len(attributes))
        self.clip = clip.eval().requires_grad_(False)  # frozen: only the tensors below learn
        self.role_map, self.attributes, self.construction = role_map, attributes, tokens
        self.first_layer, self.beta, self.num_text_tokens = first_layer, beta, num_text_tokens
        self.fuse = fuse  # what alpha weighs (fused_logits)
        L_v = depth - first_layer + 1  # vision layers from J on
        L_t = len(clip.transformer.resblocks) - first_layer + 1  # text layers from J on
        A, K = len(attributes), num_text_tokens
        W_v, W_t = clip.visual.transformer.width, clip.transformer.width

        # The learnable tensors (paper Sec. 3.3-3.4): the tokens, their projection, the fusion.
        sizes = dict(vision=(L_v, A, W_v), text=(L_t, K, W_t), proj=clip.visual.proj)
        if tokens == "separate":
            self.tokens = SeparateTokens(**sizes)
        else:  # MMRL++'s latent tokens, mapped into both towers (section 9)
            self.tokens = SharedTokens(**sizes, latent_width=latent_width)
        start = initial_fusion_logits(cls_fusion_weight if fixed_alpha is None else fixed_alpha, A)
        if fixed_alpha is None:
            self.fusion_logits = nn.Parameter(start)
        else:  # held: a buffer, which no optimiser steps and no checkpoint needs
            self.register_buffer("fusion_logits", start, persistent=False)

        # Each head's role mask from J on (paper Sec. 3.3), built once from the role map.
        self.num_image_tokens = 1 + clip.visual.grid_size**2  # N
        masks = build_role_masks(role_map, first_layer, depth, self.num_image_tokens)
        self.register_buffer("role_masks", masks, persistent=False)  # (L_v, H, N + A, N + A)

        # Our safety rules: which branches enter the fusion (blind ones and the fallback do not).
        self.blind_attributes = blind_attributes(masks, self.num_image_tokens, self.attributes)
        self.class_branch_only = class_branch_fallback and falls_back_to_class_branch(role_map)
        in_fusion = branches_in_fusion(self.attributes, self.blind_attributes,
                                       self.class_branch_only, first_layer)
        self.register_buffer("in_fusion", in_fusion, persistent=False)  # (1 + A,) bool
        # listed once: branch-ce's loss reads them each step without a host sync
        self.fused_attributes = (in_fusion[1:].nonzero().flatten() + 1).tolist()

    def learnable_tensors(self) -> Dict[str, nn.Parameter]:
        """{name: tensor} of everything that learns, as checkpoints hold them: the construction's
        (e.g. vision_tokens, or latent_tokens, vision_aligner.weight, ...), then fusion_logits."""
        learned = isinstance(self.fusion_logits, nn.Parameter)  # not under fixed_alpha
        return {**dict(self.tokens.named_parameters()),
                **({"fusion_logits": self.fusion_logits} if learned else {})}

    def learnable_parameters(self) -> List[nn.Parameter]:
        return list(self.learnable_tensors().values())

    def fusion_weights(self) -> torch.Tensor:
        """alpha = softmax(w) over the branches in the fusion, (1 + A,); alpha[0]: the class's."""
        return self.fusion_logits.masked_fill(~self.in_fusion, float("-inf")).softmax(dim=0)

    def encode_image(self, images: torch.Tensor, with_frozen: bool = False,
                     beta: Optional[float] = None):
        """images (B, 3, R, R) -> (f_cls (B, E), f_attr (B, A, E), f_frozen (B, E) or None).
        beta: the tokens' mixing (None: the model's; a test set may take its own, test_beta)."""
        beta = self.beta if beta is None else beta
        visual, j = self.clip.visual, self.first_layer - 1
        before, after = visual.transformer.resblocks[:j], visual.transformer.resblocks[j:]
        with torch.no_grad():  # nothing before J is learnable: keep no activations for backward
            x = visual.embed(images.to(self.clip.dtype))  # (B, N, W_v)
            for block in before:
                x = block(x)  # (B, N, W_v)
            frozen = None
            if with_frozen:  # plain CLIP's image feature, for L_reg (paper Sec. 3.4)
                plain = x  # the layers before J are the same in both passes: run them once
                for block in after:
                    plain = block(plain)
                frozen = visual.to_embedding(plain[:, 0])  # (B, E)
        B, N, _ = x.shape
        layer_tokens = self.tokens.vision_layer_tokens()  # (L_v, A, W_v): p_l of each layer
        for i, block in enumerate(after):
            fresh = layer_tokens[i].to(x.dtype).expand(B, -1, -1)  # (B, A, W_v)
            # MMRL++ rule: tokens entering layer l = beta * p_l + (1 - beta) * out_{l-1}.
            tokens = fresh if i == 0 else beta * fresh + (1 - beta) * tokens
            sequence = torch.cat([x, tokens], dim=1)  # (B, N + A, W_v)
            sequence = block(sequence, self.role_masks[i])  # masked per head
            x, tokens = sequence[:, :N], sequence[:, N:]
        f_cls = visual.to_embedding(x[:, 0])  # (B, E): CLS through ln_post and the frozen proj
        f_attr = visual.ln_post(tokens) @ self.tokens.attribute_projection(visual.proj)  # (B, A, E)
        return f_cls, f_attr, frozen

    @torch.no_grad()
    def prepare_classes(self, class_token_ids: torch.Tensor) -> PreparedClasses:
        """Class prompts (C, N) token ids -> the frozen text layers before J, plain CLIP's features;
        cut after the longest prompt (exact: the causal mask keeps the padding unread)."""
        clip, j = self.clip, self.first_layer - 1
        eot = class_token_ids.argmax(dim=-1)  # (C,): the end-of-text id is the largest
        x = clip.embed_text(class_token_ids[:, : int(eot.max()) + 1])  # (C, N', W_t), N' <= N
        mask = clip_model.causal_mask(x.shape[1], x.device, x.dtype)
        for block in clip.transformer.resblocks[:j]:
            x = block(x, mask)
        plain = x
        for block in clip.transformer.resblocks[j:]:
            plain = block(plain, mask)
        return PreparedClasses(hidden=x, eot=eot, frozen=clip.text_to_embedding(plain, eot))

    def encode_text(self, classes: PreparedClasses, beta: Optional[float] = None) -> torch.Tensor:
        """PreparedClasses -> t_c (C, E). As encode_image, with the K learnable tokens right after
        the start token: from J on each layer reads [start, K tokens, the prompt's other tokens],
        so t_c, the end-of-text token's state, sits at eot + K; every later token reads the tokens
        (causal mask). They get no positional embedding (CLIP adds it once, before layer 0)."""
        check(classes=classes)  # section 10
        beta = self.beta if beta is None else beta
        x, K = classes.hidden, self.num_text_tokens  # x: (C, N, W_t), the frozen layers' output
        start, words, C = x[:, :1], x[:, 1:], len(x)  # (C, 1, W_t), (C, N - 1, W_t)
        mask = clip_model.causal_mask(x.shape[1] + K, x.device, x.dtype)  # (N + K, N + K)
        layer_tokens = self.tokens.text_layer_tokens()  # (L_t, K, W_t): p_l of each layer
        for i, block in enumerate(self.clip.transformer.resblocks[self.first_layer - 1:]):
            fresh = layer_tokens[i].to(x.dtype).expand(C, -1, -1)  # (C, K, W_t)
            # MMRL++ rule: tokens entering layer l = beta * p_l + (1 - beta) * out_{l-1}.
            tokens = fresh if i == 0 else beta * fresh + (1 - beta) * tokens
            sequence = torch.cat([start, tokens, words], dim=1)  # (C, N + K, W_t)
            sequence = block(sequence, mask)
            start, tokens, words = sequence[:, :1], sequence[:, 1:1 + K], sequence[:, 1 + K:]
        return self.clip.text_to_embedding(sequence, classes.eot + K)  # end-of-text at eot + K

    def forward(self, images: torch.Tensor, classes: PreparedClasses,
                with_frozen: bool = False) -> DeAROutput:
        """Paper Eq. 6-7: branch k in {cls, attr_1..attr_A} has logits_k = s * cos(f_k, t_c), s
        CLIP's frozen scale; fused = sum_k alpha_k * logits_k (our reading), or under
        fuse="features" s * cos(sum_k alpha_k f_k / |f_k|, t_c) (scoring_logits: which one a test
        set reports)."""
        f_cls, f_attr, f_frozen = self.encode_image(images, with_frozen)
        t = self.encode_text(classes)  # (C, E)
        features = torch.cat([f_cls[:, None], f_attr], dim=1)  # (B, 1 + A, E)
        logits, branch_logits = self.fused_logits(features, t)
        return DeAROutput(logits=logits, branch_logits=branch_logits, alpha=self.fusion_weights(),
                          image_features=features, text_features=t, frozen_image_features=f_frozen,
                          frozen_text_features=classes.frozen if with_frozen else None,
                          fused_attributes=self.fused_attributes)

    def fused_logits(self, features: torch.Tensor, text_features: torch.Tensor):
        """(B, 1 + A, E), (C, E) -> (fused (B, C), branches (B, 1 + A, C)): forward's, and
        evaluation's with the text encoded once; fp32 under any autocast, the weighted sum too."""
        scale = self.clip.logit_scale.exp()
        branch_logits = cosine_logits(features, text_features, scale)  # (B, 1 + A, C), fp32
        with torch.autocast(branch_logits.device.type, enabled=False):
            alpha = self.fusion_weights().float()  # (1 + A,)
            if self.fuse == "features":  # unit features, so that alpha alone weighs them
                unit = F.normalize(features.float(), dim=-1)  # (B, 1 + A, E)
                fused_feature = torch.einsum("bae,a->be", unit, alpha)  # (B, E)
                return cosine_logits(fused_feature, text_features, scale), branch_logits
            fused = torch.einsum("bac,a->bc", branch_logits, alpha)  # a: the 1 + A branches
        return fused, branch_logits

    # Bookkeeping, not the method: the checkpoint's tensors and the parameter counts.
    def learnable_state_dict(self) -> dict:
        """Only what training changes; a checkpoint needs nothing else (CLIP is frozen)."""
        return {name: t.detach().cpu().clone() for name, t in self.learnable_tensors().items()}

    @torch.no_grad()
    def load_learnable_state_dict(self, state: dict) -> None:
        """Each checkpoint tensor into the model's, or one line naming the one that does not fit."""
        tensors = self.learnable_tensors()
        for name, value in state.items():
            expected = tuple(tensors[name].shape) if name in tensors else "no such tensor"
            if expected != tuple(value.shape):
                raise DeARError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, this "
                                f"model (tokens {self.construction!r}) expects {expected}; it was "
                                "made with other settings")
            tensors[name].copy_(value)

    def parameter_counts(self) -> Dict[str, int]:
        """{component (a name's part before any "."): its learnable parameters}, e.g. on ViT-B/16 at
        J = 9 under "shared": latent_tokens 2,560, vision_aligner 416,768, text_aligner 280,576,
        attribute_proj_residual 81,920, fusion_logits 6."""
        counts = Counter()
        for name, tensor in self.learnable_tensors().items():
            counts[name.split(".")[0]] += tensor.numel()
        return dict(counts)

    def parameter_summary(self) -> str:
        """The learnable tensors, their count and share, in one line."""
        learnable = sum(p.numel() for p in self.learnable_parameters())
        frozen = sum(p.numel() for p in self.clip.parameters())
        parts = ", ".join(f"{n} {tuple(t.shape)}" for n, t in self.learnable_tensors().items())
        return (f"learnable {learnable:,} parameters ({parts}); frozen CLIP {frozen:,} "
                f"({100 * learnable / (learnable + frozen):.2f}% learnable)")


# ---- 6. The losses (paper Sec. 3.4, METHOD.md Sec. 5): dear_loss adds them ----------------------
def self_regularization_loss(f_cls: torch.Tensor, f_cls_frozen: torch.Tensor, t: torch.Tensor,
                             t_frozen: torch.Tensor) -> torch.Tensor:
    """L_reg = mean_i (1 - cos(f_cls_i, f_cls_frozen_i)) + mean_c (1 - cos(t_c, t_c_frozen)): near
    plain CLIP's features, where the novel classes' knowledge lives."""
    image_term = 1 - F.cosine_similarity(f_cls, f_cls_frozen, dim=-1).mean()
    return image_term + (1 - F.cosine_similarity(t, t_frozen, dim=-1).mean())


def fusion_regularization_loss(alpha: torch.Tensor) -> torch.Tensor:
    """L_fusion = -log(alpha_cls): stops the fusion from abandoning the class branch."""
    return -torch.log(alpha[0])


def branch_cross_entropy(output: DeAROutput, labels: torch.Tensor) -> torch.Tensor:
    """Not the paper's loss (the branch-ce ablation): MMRL_Loss's ALPHA * CE(class branch) +
    (1 - ALPHA) * the mean CE of the attribute branches in the fusion (yunncheng/MMRL
    trainers/mmrl.py), ALPHA = MMRL_ALPHA, not output.alpha; with none, CE(class branch)."""
    branches = output.branch_logits.float()  # (B, 1 + A, C)
    class_term = F.cross_entropy(branches[:, 0], labels)
    if not output.fused_attributes:  # a branch left out has alpha 0
        return class_term
    rest = [F.cross_entropy(branches[:, k], labels) for k in output.fused_attributes]
    return MMRL_ALPHA * class_term + (1 - MMRL_ALPHA) * torch.stack(rest).mean()


def dear_loss(output: DeAROutput, labels: torch.Tensor, lambda_reg: float = 1.0,
              lambda_fusion: float = 0.1, branch_ce: bool = False) -> dict:
    """CE(fused logits) + lambda_reg * L_reg + lambda_fusion * L_fusion: each term, and 'total'.
    branch_ce (not the paper's loss): + branch_cross_entropy, each branch taught the labels too."""
    if output.frozen_image_features is None or output.frozen_text_features is None:
        raise DeARError("output has no frozen features (L_reg needs them): "
                        "call the model with with_frozen=True")
    ce = F.cross_entropy(output.logits.float(), labels)
    reg = self_regularization_loss(output.image_features[:, 0].float(),
                                   output.frozen_image_features.float(),
                                   output.text_features.float(),
                                   output.frozen_text_features.float())
    fusion = fusion_regularization_loss(output.alpha.float())
    total = ce + lambda_reg * reg + lambda_fusion * fusion
    losses = {"total": total, "ce": ce, "reg": reg, "fusion": fusion}
    if branch_ce:
        losses["branch"] = branch_cross_entropy(output, labels)
        losses["total"] = losses["total"] + losses["branch"]
    return losses


# ---- 7. The paper's ablations (its "Ablation Study"; METHOD.md Sec. 5), and the lab's controls --
# Each ablation is the DeAR row with one change, made in ablate alone. branch-ce (for the
# retrieval diagnosis) and the rest after it are ours, controls asking the paper's question.
ABLATIONS = {  # name -> what train.py's --ablations help says of it
    "no-role-mask": "every head mixed: the tokens reach every head (the row of --roles all-mixed)",
    "no-attribute-tokens": "no attribute token: the class branch and the text tokens alone",
    "no-fusion-reg": "lambda_fusion = 0: nothing holds the fusion to the class branch",
    "mask-generalization-only": "the analysed map with its attribute heads made mixed",
    "branch-ce": "NOT the paper's loss: + MMRL's 0.7 CE(class) + 0.3 CE(attribute branches)",
    "shuffled-heads": "the analysed roles permuted over its heads (seeded by the run's seed)",
    "whole-layers": "as many heads open as the analysed map opens, as whole top layers (mixed)",
    "true-heads": "toy world only: the heads its causal check singles out, as attribute heads",
    "fixed-fusion": "alpha held at MMRL's 0.7 for the class branch, the rest even, not learned",
    "feature-fusion": "alpha weighs the branches' features, then one cosine (not their logits)",
    "no-self-reg": "lambda_reg = 0: nothing holds f_cls and t_c near frozen CLIP's",
}


class Ablated(NamedTuple):
    """What one DeAR run is built and trained from, after its ablation's change (if any)."""
    role_map: RoleMap  # DeAR's role map
    attributes: List[str]  # DeAR's attribute tokens, one each
    class_branch_fallback: bool  # DeAR's: a measured map without attribute heads -> class branch
    lambda_fusion: float  # dear_loss's weight of the fusion regularisation
    branch_ce: bool  # dear_loss's: + MMRL's CE per branch
    lambda_reg: float = 1.0  # dear_loss's weight of the self-regularisation
    fuse: str = "logits"  # DeAR's: what alpha weighs (FUSE)
    fixed_alpha: Optional[float] = None  # DeAR's: alpha_cls held there, not learned (None: learned)


def generalization_mask_only(role_map: RoleMap) -> RoleMap:
    """The paper's "mask on the generalization heads only": every attribute head made mixed, so
    every token reads the image through it; all else stays as measured. Such a map has no
    attribute head on purpose: build its DeAR with class_branch_fallback=False (ablate does)."""
    heads = [replace(h, role="mixed", attribute=None) if h.role == "attribute" else replace(h)
             for h in role_map.heads]
    return replace(role_map, attributes=list(role_map.attributes), heads=heads,
                   clusters=list(role_map.clusters),
                   source=f"{role_map.source}; attribute heads made mixed")


def shuffled_heads(role_map: RoleMap, seed: int) -> RoleMap:
    """Random heads at the analysed map's counts: each head's record (role, attribute, entropy,
    picks) moved to another place by a permutation seeded by `seed`."""
    order = torch.randperm(len(role_map.heads), generator=torch.Generator().manual_seed(seed))
    heads = [replace(role_map.heads[i], layer=place.layer, head=place.head)
             for place, i in zip(role_map.heads, order.tolist())]
    return replace(role_map, attributes=list(role_map.attributes), heads=heads,
                   clusters=list(role_map.clusters),
                   source=f"{role_map.source}; heads shuffled (seed {seed})")


def whole_layers(role_map: RoleMap) -> RoleMap:
    """The layer-centric view at the analysed map's openness: its heads open to the tokens
    (attribute or mixed), counted in layers and rounded half up (6 of 8 heads: 1 layer), taken
    from the top as whole mixed layers; every other head of its layers generalization."""
    opened = sum(h.role != "generalization" for h in role_map.heads)
    top = role_map.layers[::-1][:math.floor(opened / role_map.num_heads + 0.5)]
    heads = [HeadRole(h.layer, h.head, "mixed" if h.layer in top else "generalization")
             for h in role_map.heads]
    return RoleMap(role_map.vision_layers, role_map.num_heads, list(role_map.attributes), heads,
                   source=f"whole-layers: the top {len(top)} layers mixed ({opened} heads open)")


def ablate(name: Optional[str], role_map: RoleMap, attributes: List[str], lambda_fusion: float,
           lambda_reg: float = 1.0, seed: int = 0, true_map: Optional[RoleMap] = None) -> Ablated:
    """The one change of ablation `name` (None: none) to the DeAR row's role map, attribute tokens,
    fusion and loss -> Ablated; DeAR is built and dear_loss called from it, nothing else switches.
    seed: the run's (shuffled-heads); true_map: the toy's true heads (true-heads; the caller has
    them from the causal check, toyworld.causal.true_role_map). `changes` below holds one row per
    ablation: its name, its change, and where it acts (the fields it replaces)."""
    def uniform_mixed(attributes: List[str]) -> RoleMap:  # --roles all-mixed's map
        return RoleMap.uniform("mixed", role_map.vision_layers, role_map.num_heads,
                               attributes=attributes)

    changes = {  # name -> the fields of the DeAR row it replaces, made only when asked
        "no-role-mask": lambda: dict(role_map=uniform_mixed(list(attributes))),  # all-mixed's row
        "no-attribute-tokens": lambda: dict(role_map=uniform_mixed([]), attributes=[]),  # K stays
        "no-fusion-reg": lambda: dict(lambda_fusion=0.0),
        "mask-generalization-only": lambda: dict(role_map=generalization_mask_only(role_map),
                                                 class_branch_fallback=False),  # on purpose
        "branch-ce": lambda: dict(branch_ce=True),  # not the paper's loss (branch_cross_entropy)
        "shuffled-heads": lambda: dict(role_map=shuffled_heads(role_map, seed)),
        "whole-layers": lambda: dict(role_map=whole_layers(role_map)),
        "true-heads": lambda: dict(role_map=true_map),
        "fixed-fusion": lambda: dict(fixed_alpha=MMRL_ALPHA),
        "feature-fusion": lambda: dict(fuse="features"),
        "no-self-reg": lambda: dict(lambda_reg=0.0),
    }
    if name is not None and name not in changes:
        raise DeARError(f"ablation {name!r}: use one of {', '.join(ABLATIONS)}")
    if name == "true-heads" and true_map is None:
        raise DeARError("ablation 'true-heads' needs true_map, the heads a causal check "
                        "singles out (the toy world's: toyworld.causal.true_role_map)")
    change = Ablated(role_map, list(attributes), True, lambda_fusion, False, lambda_reg)
    return change if name is None else change._replace(**changes[name]())


# ---- 8. At test time: the logits that score a test set (METHOD.md Sec. 5); retrieval -------------
def scoring_logits(fusion: str, trained: bool) -> str:
    """Which of DeAR's logits score a test set, "fused" or "class" (the class branch alone), under
    each fusion rule (METHOD.md Sec. 5: the paper does not say which its tables use).
    trained: the test classes are the trained ones, in the trained domain (a base split).
      fused-everywhere: the fused logits on every test set (weights learned on the trained classes);
      class-on-unseen:  fused where trained, the class branch alone elsewhere (MMRL's code)."""
    if fusion == "fused-everywhere":
        return "fused"
    if fusion == "class-on-unseen":
        return "fused" if trained else "class"
    raise DeARError(f"fusion={fusion!r}: use fused-everywhere or class-on-unseen")


# MMRL++ tests each cross/dg target at its own beta: trainers/config.py (task CD), merged by the
# target's test call (scripts/mmrlpp/cross_datasets_test.sh) into trainers/mmrlpp.py's model.
MMRLPP_TEST_BETA = {"imagenet": 0.9, "imagenet_v2": 0.9, "imagenet_r": 0.9, "imagenet_a": 0.8,
                    "imagenet_sketch": 0.7, "fgvc_aircraft": 0.9, "ucf101": 0.9, "sun397": 0.7,
                    "oxford_pets": 0.6, "caltech101": 0.6, "dtd": 0.5, "oxford_flowers": 0.4,
                    "stanford_cars": 0.3, "eurosat": 0.3, "food101": 0.3}


def test_beta(test_set: str, trained: bool, beta: float, per_target: bool = True) -> float:
    """DeAR's beta on a test set (encode_image's and encode_text's): `beta`, the training one, on
    the trained classes; elsewhere MMRL++'s for that dataset when per_target (train.py's
    --test-beta per-target; a dataset it does not name, our choice: the training beta)."""
    return beta if trained or not per_target else MMRLPP_TEST_BETA.get(test_set, beta)


# The paper's check that a token carries its attribute: rank images by one token's feature.
@torch.no_grad()
def retrieval_features(model: DeAR, images: torch.Tensor) -> dict:
    """images (B, 3, R, R) -> {"class", each attribute but the blind, "frozen CLIP"}: unit (B, E)"""
    f_cls, f_attr, f_frozen = model.encode_image(images, with_frozen=True)
    features = {"class": f_cls, **dict(zip(model.attributes, f_attr.unbind(dim=1))),
                "frozen CLIP": f_frozen}
    return {name: F.normalize(value.float(), dim=-1) for name, value in features.items()
            if name not in model.blind_attributes}


def rank_gallery(queries: torch.Tensor, gallery: torch.Tensor, k: int,
                 same_images: bool = False) -> torch.Tensor:
    """Queries (Q, E), gallery (M, E), normalised -> (Q, k) indices, most similar first;
    same_images: the queries are the gallery, each left out of its own list."""
    similarity = queries @ gallery.T  # (Q, M)
    if same_images:
        similarity.fill_diagonal_(float("-inf"))
    return similarity.topk(min(k, similarity.shape[1] - int(same_images)), dim=1).indices


def precision_at_k(ranking: torch.Tensor, query_values: Sequence,
                   gallery_values: Sequence) -> float:
    """ranking (Q, k) -> the share of retrieved images whose value (e.g. colour) is the query's."""
    hits = [sum(gallery_values[j] == query_values[q] for j in row) / len(row)
            for q, row in enumerate(ranking.tolist())]
    return sum(hits) / len(hits)


# ---- 9. The other token construction: MMRL++'s shared space (tokens="shared", METHOD.md Sec. 4) --
# MMRL++ (yunncheng/MMRL trainers/mmrlpp.py, clip/model_mmrlpp.py; configs/trainers/MMRLpp/
# vit_b16.yaml) learns one set of latent tokens and maps it into the token layers of both towers.
class TowerAligner(nn.Module):
    """One tower's map of the latent tokens into its L token layers (L_v or L_t; W its width),
    MMRL++'s Shared_Residual_Representation_Aligner (a Residual_Aligner per layer):
    p_l = z (M + a_l b_l)^T + c_l. z (K, W_z) the latent tokens; M (W, W_z) one linear map for every
    layer (an nn.Linear's start, learned); a_l (W, Q) Kaiming-uniform and b_l (Q, W_z) zero, layer
    l's rank-Q residual, so every layer starts from M; c_l (W,) each layer's bias (the linear's)."""

    def __init__(self, latent_width: int, width: int, layers: int, rank: int):
        super().__init__()
        linear = nn.Linear(latent_width, width)  # MMRL++'s fresh nn.Linear: its random start
        self.weight = nn.Parameter(linear.weight.detach().clone())  # (W, W_z): M, shared by layers
        self.bias = nn.Parameter(linear.bias.detach().repeat(layers, 1))  # (L, W): a copy each
        self.a = nn.Parameter(torch.empty(layers, width, rank))  # (L, W, Q)
        for a_l in self.a.data:  # Residual_Aligner's A: kaiming_uniform_(a=sqrt(5)) over fan-in Q
            nn.init.kaiming_uniform_(a_l, a=math.sqrt(5))
        self.b = nn.Parameter(torch.zeros(layers, rank, latent_width))  # (L, Q, W_z): B = 0

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        """latent (K, W_z) -> every layer's tokens (L, K, W)."""
        shared = latent @ self.weight.T  # (K, W): the map all layers share
        low = torch.einsum("kz,lqz->lkq", latent, self.b)  # (L, K, Q): z b_l^T
        residual = torch.einsum("lkq,lwq->lkw", low, self.a)  # (L, K, W): z b_l^T a_l^T
        return shared + residual + self.bias[:, None]  # (L, K, W)


class LowRankResidual(nn.Module):
    """The attribute projection's learnable part, a b with a (W_v, Q) Kaiming-uniform and b (Q, E)
    zero, so that proj + a b starts as proj (MMRL++'s VisionTransformer.A, .B: proj + A @ B)."""

    def __init__(self, rows: int, cols: int, rank: int):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rows, rank))  # (W_v, Q)
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.b = nn.Parameter(torch.zeros(rank, cols))  # (Q, E)

    def forward(self) -> torch.Tensor:
        return self.a @ self.b  # (W_v, E)


class SharedTokens(nn.Module):
    """tokens="shared": latent tokens z (K, W_z) (normal, std 0.02; W_z = latent_width, default
    W_t, 512 on ViT-B/16 as MMRL++'s) mapped into each token layer of both towers, one TowerAligner
    each, so K = A; the attribute projection is proj, frozen, plus a LowRankResidual. A tensor is
    built only where it acts: A = 0, no vision map and no residual; K = 0, no latent token and no
    text map. Same arguments as SeparateTokens."""

    def __init__(self, *, vision: Sequence[int], text: Sequence[int], proj: torch.Tensor,
                 latent_width: Optional[int] = None):
        super().__init__()
        (L_v, A, W_v), (L_t, K, W_t), E = vision, text, proj.shape[1]
        W_z, Q = W_t if latent_width is None else latent_width, SHARED_RESIDUAL_RANK
        self.latent_tokens = nn.Parameter(torch.randn(K, W_z) * 0.02) if K else None  # (K, W_z)
        self.vision_aligner = TowerAligner(W_z, W_v, L_v, Q) if A else None
        self.text_aligner = TowerAligner(W_z, W_t, L_t, Q) if K else None
        self.attribute_proj_residual = LowRankResidual(W_v, E, SHARED_PROJ_RANK) if A else None
        self.vision_shape, self.text_shape = tuple(vision), tuple(text)
        self.register_buffer("empty", torch.zeros(0), persistent=False)  # empty tokens' device

    def vision_layer_tokens(self) -> torch.Tensor:  # p_l, z through each layer's map: (L_v, A, W_v)
        if self.vision_aligner is None:  # A = 0: empty
            return self.empty.new_zeros(self.vision_shape)
        return self.vision_aligner(self.latent_tokens)

    def text_layer_tokens(self) -> torch.Tensor:  # p_l, z through each layer's map: (L_t, K, W_t)
        if self.text_aligner is None:  # K = 0: empty
            return self.empty.new_zeros(self.text_shape)
        return self.text_aligner(self.latent_tokens)

    def attribute_projection(self, proj: torch.Tensor) -> torch.Tensor:
        """(W_v, E): CLIP's frozen proj plus the learnable residual (MMRL++'s proj + A @ B)."""
        if self.attribute_proj_residual is None:  # A = 0: nothing to project
            return proj
        return proj + self.attribute_proj_residual()


# ---- 10. Bookkeeping, not the method: the argument checks, one table (the harness calls the same
# before any work); RoleMap with its checks, JSON file and table.
def is_real(value) -> bool:  # NaN and inf are not
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# (the arguments a rule reads, the rule, its one line when it fails), in the order check runs them
ARGUMENT_RULES = [
    ("first_layer depth", lambda j, depth: type(j) is int and 1 <= j <= depth,
     "first_layer J={first_layer} is out of range: use 1..{depth} (1-based, as the paper's J = 9)"),
    ("beta", lambda beta: is_real(beta) and 0.0 <= beta <= 1.0,
     "beta={beta} is outside [0, 1]; beta weighs the fresh tokens against the previous layer's"),
    ("low_bits", lambda low: low is None or is_real(low) and low >= 0,
     "low_bits={low_bits}: expected a finite entropy in bits, >= 0"),
    ("high_bits", lambda high: high is None or is_real(high) and high >= 0,
     "high_bits={high_bits}: expected a finite entropy in bits, >= 0"),
    ("low_bits high_bits", lambda low, high: None in (low, high) or low <= high,
     "low_bits={low_bits:g} is above high_bits={high_bits:g}; make the low threshold the smaller"),
    ("tokens", lambda tokens: tokens in TOKEN_CONSTRUCTIONS,
     "tokens={tokens!r}: use " + " or ".join(TOKEN_CONSTRUCTIONS)),
    ("tokens num_attributes num_text_tokens",  # K under "shared": default_text_tokens
     lambda tokens, A, K: tokens != "shared" or A or K is not None,
     "tokens 'shared' without attribute tokens: give num_text_tokens, the latent tokens the text "
     "tower alone receives (the full row's K, default_text_tokens('shared', A), as train.py "
     "passes it)"),
    ("tokens num_attributes num_text_tokens",
     lambda tokens, A, K: tokens != "shared" or not A or K in (None, A),
     "K = {num_text_tokens} text tokens: under tokens 'shared' the text tower receives the "
     "A = {num_attributes} tokens of the vision tower; leave K unset (it follows A)"),
    ("num_text_tokens", lambda K: K is None or K >= 0,
     "num_text_tokens={num_text_tokens} must be 0 or more"),
    ("latent_width tokens", lambda width, tokens: width is None or tokens == "shared" and width >= 1,
     "latent_width={latent_width}: the latent tokens' width, 1 or more, for tokens='shared' only"),
    ("cls_fusion_weight", lambda weight: 0.0 < weight < 1.0,
     "cls_fusion_weight={cls_fusion_weight} must be in (0, 1)"),
    ("concepts", lambda concepts: concepts in CONCEPT_SOURCES,
     "concepts={concepts!r}: use " + " or ".join(CONCEPT_SOURCES)),
    ("concepts bank", lambda concepts, bank: concepts != "labels" or all(
        entry.concept is not None for entry in bank),
     "concepts 'labels' needs a label on every description (give 'text<TAB>concept' lines) "
     "or let clusters find the concepts"),
    ("rank", lambda rank: rank >= 1,
     "rank={rank}: TextSpan keeps the top `rank` singular directions; use 1 or more"),
    ("num_images", lambda n: n >= 2,
     "the head analysis has {num_images} image(s); TextSpan needs at least 2 to see a head vary"),
    ("image_batch", lambda batch: isinstance(batch, torch.Tensor) and batch.dim() == 4,
     "image_batches must be a (n, 3, R, R) tensor or yield (B, 3, R, R) tensors, 4 dimensions; "
     "got a {image_batch.__class__.__name__} (a DataLoader's: pass (x for x, _ in loader))"),
    ("classes", lambda classes: isinstance(classes, PreparedClasses),
     "classes must be model.prepare_classes(class_token_ids), got a {classes.__class__.__name__}; "
     "prepare each class list once, then pass the result to every step"),
]


def check(**given) -> None:
    """The argument checks in one pass: each rule of ARGUMENT_RULES whose arguments are all given;
    the first that fails is one DeARError line, e.g. check(beta=2.0)."""
    for names, holds, message in ARGUMENT_RULES:
        if all(name in given for name in names.split()):
            if not holds(*(given[name] for name in names.split())):
                raise DeARError(message.format(**given))


def analysis_picks(requested: Optional[int], bank_size: int, num_images: int, *, rank: int,
                   default: int, embed_dim: Optional[int] = None) -> int:
    """TextSpan's picks per head (the one check of it): `requested` (--descriptions) or `default`
    (default_picks), at most min(bank size, num_images, rank, embed_dim), the span's rank. A request
    above that, or below 1, is refused."""
    check(rank=rank, num_images=num_images)
    limits = [(bank_size, f"the bank has {bank_size} descriptions"),
              (num_images, f"the span of {num_images} images' contributions has rank <= "
                           f"{num_images}"),
              (rank, f"TextSpan keeps {rank} singular directions"),
              (embed_dim or math.inf, f"the embedding has {embed_dim} dimensions")]
    limit, why = min(limits, key=lambda entry: entry[0])
    if requested is None:
        if default > limit:
            warnings.warn(f"TextSpan makes {limit} picks per head, "
                          f"not the default {default}: {why}")
        return min(default, limit)
    if not 1 <= requested <= limit:
        more = " or give the analysis more images" if limit == num_images else ""
        raise DeARError(f"--descriptions {requested}: TextSpan can make 1..{limit} picks per head "
                        f"here ({why}); ask for at most {limit}{more}")
    return requested


def hdbscan(points: torch.Tensor, min_cluster_size: int,
            min_samples: Optional[int] = None) -> torch.Tensor:
    """clustering.hdbscan, imported only when the picks are clustered (dear.py runs without
    clustering.py): (P, d) -> (P,) cluster ids, -1 = noise; its ClusteringError as DeARError."""
    try:  # beside dear.py: in a package the relative import, at the top level the other
        from . import clustering
    except ImportError:
        try:
            import clustering
        except ImportError:
            raise DeARError("clustering the picks needs clustering.py (HDBSCAN; torch and numpy): "
                            "copy clustering.py beside dear.py, or use concepts='labels'") from None
    try:
        return clustering.hdbscan(points, min_cluster_size, min_samples)
    except clustering.ClusteringError as error:
        raise DeARError(str(error)) from None


def clusters_line(found: List[str], clusters: List[Cluster], min_cluster_size: int) -> str:
    """find_concepts' log line: the distinct picks, and each cluster's id, name and size."""
    named = ", ".join(f"{c.id} {c.name} ({c.size})" for c in clusters)
    return (f"  head analysis: {len(found)} distinct picks in {len(clusters)} clusters "
            f"({found.count(NOISE)} in none; HDBSCAN min_cluster_size {min_cluster_size})"
            + (f": {named}" if clusters else "; with no cluster, every pick is a concept of its "
               "own and no head is specialised"))


def checked_embeddings(embed_texts: Callable[[List[str]], torch.Tensor],
                       texts: List[str]) -> torch.Tensor:
    """embed_texts(texts) as a (len(texts), d) float CPU tensor, or one line saying what came."""
    embedded = torch.as_tensor(embed_texts(texts))  # e.g. a numpy array (sentence-transformers')
    if embedded.dim() != 2 or len(embedded) != len(texts) or not embedded.is_floating_point():
        raise DeARError(f"embed_texts returned a {embedded.dtype} tensor of shape "
                        f"{tuple(embedded.shape)} for {len(texts)} texts; "
                        f"it must return ({len(texts)}, D) floats")
    return embedded.detach().float().cpu()


@dataclass
class RoleMap:
    """The role of every head of the analysed vision layers: the record sections 3-7 pass around."""
    vision_layers: int  # depth of the vision tower it was made for
    num_heads: int  # heads per layer of that tower
    attributes: List[str]  # the attribute tokens' names, in token order
    heads: List[HeadRole]  # one per (layer, head), layer-major
    low_bits: Optional[float] = None  # the entropy thresholds that made it (None: not measured)
    high_bits: Optional[float] = None
    source: str = "analysis"  # "analysis" or the name of a fixed choice ("all-mixed", ...)
    concepts: Optional[str] = None  # where the analysis took its concepts: "clusters" or "labels"
    clusters: List[Cluster] = field(default_factory=list)  # found (concepts="clusters")

    @property
    def layers(self) -> List[int]:
        return sorted({h.layer for h in self.heads})  # 0-based, ascending

    def role_of(self, layer: int, head: int) -> Optional[HeadRole]:
        return next((h for h in self.heads if h.layer == layer and h.head == head), None)

    @classmethod
    def uniform(cls, role: str, vision_layers: int, num_heads: int,
                layers: Optional[Sequence[int]] = None,
                attributes: Sequence[str] = CORE_ATTRIBUTES) -> RoleMap:
        """The --roles all-mixed and all-generalization maps, built here alone: every head of
        `layers` (None: the analysed ones, the last four) "mixed" (deep prompting, no mask, the
        layer-centric view of MaPLe, PromptSRC, MMRL) or "generalization" (all blind)."""
        if role not in ("mixed", "generalization"):
            raise DeARError(f"uniform role must be 'mixed' or 'generalization', not {role!r}")
        if layers is None:
            layers = range(vision_layers - analysed_layers(vision_layers), vision_layers)
        heads = [HeadRole(layer, head, role) for layer in layers for head in range(num_heads)]
        return cls(vision_layers, num_heads, list(attributes), heads, source=f"all-{role}")

    def validate(self, vision_layers: Optional[int] = None, num_heads: Optional[int] = None,
                 attributes: Optional[Sequence[str]] = None) -> None:
        """Complete, consistent, and (when the sizes are given) fits the model."""
        for given, own, what in ((vision_layers, self.vision_layers, "a vision tower of {} layers"),
                                 (num_heads, self.num_heads, "{} heads per layer")):
            if given not in (None, own):
                raise DeARError(f"made for {what.format(own)}, this model has {given}; "
                                "re-run the head analysis for this model")
        if attributes is not None and list(attributes) != list(self.attributes):
            raise DeARError(f"made for attributes {', '.join(self.attributes)}, "
                            f"the model has {', '.join(attributes)}; leave DeAR's attributes out "
                            "(it then takes the map's) or re-run the analysis with these")
        for entry in self.heads:
            where = f"layer {entry.layer + 1} (index {entry.layer}), head {entry.head}"
            if not (0 <= entry.layer < self.vision_layers and 0 <= entry.head < self.num_heads):
                raise DeARError(f"{where} is outside a tower of {self.vision_layers} layers "
                                f"x {self.num_heads} heads")
            if entry.role not in ROLES:
                raise DeARError(f"{where} has role {entry.role!r}; roles are {', '.join(ROLES)}")
            if entry.role == "attribute" and entry.attribute not in self.attributes:
                raise DeARError(f"{where} is an attribute head for {entry.attribute!r}, which is "
                                f"not one of the attributes ({', '.join(self.attributes)})")
        for layer in self.layers:
            present = sorted(h.head for h in self.heads if h.layer == layer)
            if present != list(range(self.num_heads)):
                raise DeARError(f"layer {layer + 1} (index {layer}) lists heads {present}, "
                                f"expected each of 0..{self.num_heads - 1} once")

    def save(self, path: str) -> None:
        data = {"what": "DeAR head roles (layer and head are 0-based; the paper's layer = "
                        "layer + 1)", "source": self.source, "vision_layers": self.vision_layers,
                "num_heads": self.num_heads, "attributes": list(self.attributes),
                "thresholds_bits": {"low": self.low_bits, "high": self.high_bits},
                "concepts": self.concepts, "clusters": [asdict(c) for c in self.clusters],
                "heads": [asdict(h) for h in self.heads]}
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
        clip_model.atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    @classmethod
    def load(cls, path: str) -> RoleMap:
        """Read a role file; each problem is one DeARError line that names the file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            thresholds = data.get("thresholds_bits") or {}
            role_map = cls(int(data["vision_layers"]), int(data["num_heads"]),
                           list(data["attributes"]), [HeadRole(**h) for h in data["heads"]],
                           thresholds.get("low"), thresholds.get("high"),
                           data.get("source", "analysis"), data.get("concepts"),
                           [Cluster(**c) for c in data.get("clusters") or []])
            role_map.validate()
        except FileNotFoundError:
            raise DeARError(f"{path}: no such role file; run the head analysis first "
                            "(analyze_heads, then RoleMap.save) or use "
                            "RoleMap.uniform('mixed', ...) (no mask)") from None
        except DeARError as error:
            raise DeARError(f"{path}: {error}") from None
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DeARError(f"{path}: not a DeAR role file ({type(error).__name__}: "
                            f"{' '.join(str(error).split())[:80]}); "
                            "re-run the head analysis") from None
        return role_map

    def table(self) -> str:
        """A row per layer (1-based), a cell per head: A:col (attribute head for colour), G, M,
        each with its entropy in bits."""
        def cell(entry: HeadRole) -> str:  # e.g. "A:col 0.00"
            tag = {"attribute": f"A:{(entry.attribute or '')[:3]}", "generalization": "G",
                   "mixed": "M"}[entry.role]
            return (tag + ("" if entry.entropy is None else f" {entry.entropy:.2f}")).rjust(9)

        bits = ["-" if v is None else f"{v:.2f}" for v in (self.low_bits, self.high_bits)]
        lines = [f"Head roles ({self.source})",
                 f"layers 1-based (the paper's), heads 0-based; A:col attribute head for colour, G "
                 f"generalization, M mixed, then the entropy; low {bits[0]}, high {bits[1]} bits",
                 "layer | " + " ".join(f"{'h' + str(h):>9}" for h in range(self.num_heads))]
        for layer in self.layers:
            cells = [cell(self.role_of(layer, head)) for head in range(self.num_heads)]
            lines.append(f"{layer + 1:>5} | " + " ".join(cells))
        counts = Counter(f"attribute:{h.attribute}" if h.role == "attribute" else h.role
                         for h in self.heads)
        lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        if falls_back_to_class_branch(self):
            lines.append("no attribute head: no head is specialised enough (entropy <= low); "
                         "DeAR falls back to the class branch alone (falls_back_to_class_branch)")
        return "\n".join(lines)


def format_head_mask(mask: torch.Tensor, num_image_tokens: int, attributes: Sequence[str]) -> str:
    """An (N + A, N + A) role mask as text, the image tokens folded into one: '#' = may attend."""
    N, names = num_image_tokens, ["image"] + [a[:8] for a in attributes]
    kept = [0] + list(range(N, len(mask)))  # the image tokens' rows are alike by construction
    folded = mask[kept][:, kept]  # (1 + A, 1 + A)
    rows = [f"{name:>11} " + " ".join(f"{'#' if v == 0 else '.':>8}" for v in row)
            for name, row in zip(names, folded)]
    return "\n".join(["query \\ key " + " ".join(f"{n:>8}" for n in names)] + rows)


if __name__ == "__main__":  # a small demonstration on a random CLIP (no weights needed)
    torch.manual_seed(0)
    demo_clip = clip_model.CLIP(embed_dim=64, image_resolution=32, vision_layers=4,
                                vision_width=128, vision_patch_size=8, vision_heads=4,
                                context_length=16, vocab_size=100, transformer_width=64,
                                transformer_heads=2, transformer_layers=4).eval()
    heads = [HeadRole(3, 0, "attribute", "colour"), HeadRole(3, 1, "attribute", "shape"),
             HeadRole(3, 2, "generalization"), HeadRole(3, 3, "mixed")]
    demo_roles = RoleMap(4, 4, ["colour", "shape"], heads, source="hand-made demo")
    print(demo_roles.table())
    demo = DeAR(demo_clip, demo_roles, attributes=["colour", "shape"], first_layer=4)
    print(demo.parameter_summary())
    for head, entry in enumerate(heads):
        print(f"\nlayer 4 (index 3), head {head}: {entry.role} {entry.attribute or ''}")
        print(format_head_mask(demo.role_masks[0, head], demo.num_image_tokens, demo.attributes))
    prompts = [[98, 3 * c + 5, 3 * c + 6, 3 * c + 7, 99] + [0] * 11 for c in range(3)]
    ids = torch.tensor(prompts)  # (C, N) = (3, 16): three class prompts
    out = demo(torch.randn(2, 3, 32, 32), demo.prepare_classes(ids), with_frozen=True)
    losses = dear_loss(out, torch.tensor([0, 2]))
    rounded = {k: round(v.item(), 4) for k, v in losses.items()}
    print("\nfused logits", tuple(out.logits.shape), "losses", rounded)
