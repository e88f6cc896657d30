"""Concepts discovered as the paper does (DeAR Sec. 3.2): TextSpan's picks clustered without
labels, each head's concept entropy over the clusters, clusters named for the core attributes.

What is checked: how a pick in no cluster counts; the two naming rules (a labelled pool's
majority label, an unlabelled pool's mutual-nearest attribute name) and the user's override;
that clusters which recover a labelled bank's concepts give the labels' roles exactly; the
description-pool file format and its errors; the clusters' record (roles.json, clusters.md with
the adjusted Rand index against scikit-learn's). HDBSCAN itself: tests/test_hdbscan.py.

    python -m pytest -q tests/test_concepts.py
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dear  # noqa: E402
from harness import reports  # noqa: E402
from harness.bank import project_bank, read_descriptions  # noqa: E402
from harness.errors import TrainError  # noqa: E402
NOISE = dear.NOISE


# ---- concept entropy over clusters: a pick in no cluster is a concept of its own ----------
@pytest.mark.parametrize("concepts, bits", [
    (["cluster 0"] * 3 + [NOISE], -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))),  # 0.81
    (["cluster 0"] * 2 + [NOISE] * 2, 1.5),  # two unlike picks: two concepts, not one "noise" concept (1.0)
    ([NOISE] * 4, 2.0),  # nothing alike: as spread as four picks can be
    (["cluster 1", "cluster 0", "cluster 1", "cluster 0"], 1.0),
])
def test_a_pick_in_no_cluster_counts_as_a_concept_of_its_own(concepts, bits):
    assert dear.concept_entropy(concepts) == pytest.approx(bits, abs=1e-12)


def test_the_dominant_concept_is_never_noise_while_a_cluster_is_there():
    assert dear.dominant_concept([NOISE, NOISE, "cluster 4", NOISE]) == "cluster 4"
    assert dear.dominant_concept([NOISE, "cluster 2", "cluster 5", "cluster 5"]) == "cluster 5"
    assert dear.dominant_concept([NOISE, NOISE]) == NOISE


def test_roles_follow_the_names_of_the_clusters():
    heads = [["cluster 3"] * 3 + [NOISE], ["cluster 1"] * 3 + ["cluster 3"], [NOISE] * 4,
             ["cluster 1", "cluster 3", "cluster 1", "cluster 3"]]
    names = {"cluster 3": "colour", "cluster 1": "other", NOISE: NOISE}  # as find_concepts names them
    low, high = dear.default_thresholds(4, 6)
    assert (low, high) == pytest.approx((0.811278, 4 / 3), abs=1e-6)
    dominants = [names[dear.dominant_concept(h)] for h in heads]
    roles = dear.assign_roles([dear.concept_entropy(h) for h in heads], dominants, ["colour", "shape"], low, high)
    # 3 of 4 on a colour cluster: a colour head; on an "other" cluster: no token, generalization.
    assert roles == [("attribute", "colour"), ("generalization", None), ("generalization", None), ("mixed", None)]


# ---- naming the clusters --------------------------------------------------------------------
def test_a_labelled_pool_names_each_cluster_by_its_most_common_label_if_core():
    concepts = ["cluster 0", "cluster 0", "cluster 0", "cluster 1", "cluster 1", NOISE]
    labels = ["colour", "colour", "shape", "style", "style", "shape"]
    assert dear.name_by_labels(concepts, labels, ["colour", "shape"]) == {"cluster 0": "colour", "cluster 1": "other"}


def test_without_labels_an_attribute_names_only_a_mutually_nearest_cluster():
    centres = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [0.0, 0.0, 1.0]])  # (3 clusters, D)
    anchors = torch.tensor([[1.0, 0.0, 0.01], [1.0, 0.2, 0.0], [0.0, 0.2, 1.0]])  # colour, shape, texture
    names = dear.name_by_anchors(centres, anchors, ["colour", "shape", "texture"])
    # Colour and shape both lie nearest cluster 0, whose nearest attribute is colour: shape names
    # nothing (cluster 1 is only its second nearest) and cluster 1 stays "other".
    assert names == {"cluster 0": "colour", "cluster 1": "other", "cluster 2": "texture"}


def test_cluster_picks_groups_alike_texts_and_lists_the_most_central_first():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, generator=generator), torch.randn(16, generator=generator)
    group_a = [a + 0.01 * k * torch.randn(16, generator=generator) for k in range(1, 6)]
    group_b = [b + 0.01 * k * torch.randn(16, generator=generator) for k in range(1, 6)]
    lonely = torch.randn(16, generator=generator)
    texts = [f"a{k}" for k in range(5)] + [f"b{k}" for k in range(5)] + ["lonely"]
    concepts, clusters, centres = dear.cluster_picks(texts, torch.stack(group_a + group_b + [lonely]), 4)
    assert concepts[-1] == NOISE and len(set(concepts[:5])) == 1 and len(set(concepts[5:10])) == 1
    assert concepts[0] != concepts[5] and centres.shape == (2, 16)
    first = next(c for c in clusters if f"cluster {c.id}" == concepts[0])
    assert first.size == 5 and first.central[0] == "a0" and first.name == "other"  # a0: the least perturbed


# ---- the whole analysis: clusters that recover the labels give the labels' roles ------------
def planted_bank_and_encoder(bank):
    """An encoder that knows each labelled phrase's concept: every phrase of a concept lands near
    one point of its own (and each attribute's name near its concept's), so HDBSCAN must recover
    the labels and the anchors must name each core concept."""
    concepts = sorted({entry.concept for entry in bank})
    generator = torch.Generator().manual_seed(1)
    points = {c: 10 * torch.randn(32, generator=generator) for c in concepts}
    of_text = {entry.text: entry.concept for entry in bank} | {c: c for c in concepts}

    def embed_texts(texts):
        return torch.stack([points[of_text[t]] + 0.01 * torch.randn(32, generator=generator) for t in texts])
    return embed_texts


def test_clusters_that_recover_the_labels_give_the_labels_roles(tiny_deep_clip, monkeypatch):
    bank = project_bank()
    by_concept = {}
    for index, entry in enumerate(bank):
        by_concept.setdefault(entry.concept, []).append(index)
    generator = torch.Generator().manual_seed(0)
    spread = [by_concept[c][k] for k, c in enumerate(["colour", "shape", "texture", "object", "style", "mood"])]
    plan = [by_concept["colour"][:6], by_concept["shape"][:5] + by_concept["style"][:1],  # 0 and 0.65 bits
            by_concept["texture"][:3] + by_concept["object"][:3], spread]  # 1 bit: mixed; 2.58: generalization
    plan += [[by_concept[c][int(torch.randint(0, 30, (1,), generator=generator)) % len(by_concept[c])]
              for c in ("count", "time", "mood", "text", "viewpoint", "lighting")] for _ in range(8)]
    fake_text = torch.nn.functional.normalize(torch.randn(len(bank), 32, generator=generator), dim=-1)
    monkeypatch.setattr(dear, "encode_descriptions", lambda clip, tok, texts: fake_text[:len(texts)])
    images = torch.randn(24, 3, 32, 32, generator=generator)

    def analyse(pool=bank, **concepts):  # TextSpan's picks planted, head by head in layer-major order
        picks = iter(plan)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dear, "textspan", lambda *args: next(picks))
            return dear.analyze_heads(tiny_deep_clip, images, None, pool, num_layers=3, num_descriptions=6,
                                      log=lambda line: None, **concepts)

    labels = analyse(concepts="labels")
    roles = [(h.role, h.attribute) for h in labels.heads]
    assert roles[:4] == [("attribute", "colour"), ("attribute", "shape"), ("mixed", None), ("generalization", None)]
    encoder = planted_bank_and_encoder(bank)
    clusters = analyse(concepts="clusters", embed_texts=encoder, min_cluster_size=2)
    assert [(h.role, h.attribute) for h in clusters.heads] == roles
    assert [h.entropy for h in clusters.heads] == pytest.approx([h.entropy for h in labels.heads])
    assert clusters.concepts == "clusters" and all(c.startswith("cluster ") for h in clusters.heads
                                                  for c in h.concepts)
    assert len(clusters.clusters) == len({bank[i].concept for head in plan for i in head})
    # The same pool without its labels: the attributes' names, embedded, name the clusters.
    unlabelled = [dear.Description(entry.text) for entry in bank]
    anchored = analyse(unlabelled, embed_texts=encoder, min_cluster_size=2)
    assert [(h.role, h.attribute) for h in anchored.heads] == roles
    # The user's word wins over the rule: the colour cluster renamed "other" makes no colour head.
    colour = next(c.id for c in clusters.clusters if c.name == "colour")
    overridden = analyse(concepts="clusters", embed_texts=encoder, min_cluster_size=2, cluster_names={colour: "other"})
    assert [(h.role, h.attribute) for h in overridden.heads][:2] == [("generalization", None), ("attribute", "shape")]


def test_an_encoder_of_the_wrong_shape_is_one_line(tiny_clip):
    bank = [dear.Description(f"phrase {k}") for k in range(10)]
    images = torch.randn(12, 3, 32, 32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dear, "encode_descriptions", lambda clip, tok, texts: torch.randn(len(texts), 32))
        with pytest.raises(dear.DeARError, match=r"embed_texts returned a torch.float32 tensor of shape \(3, 8\)"):
            dear.analyze_heads(tiny_clip, images, None, bank, num_descriptions=2, log=lambda line: None,
                               embed_texts=lambda texts: torch.zeros(3, 8))


def test_labels_need_every_description_labelled():
    with pytest.raises(dear.DeARError, match="needs a label on every description"):
        dear.check(concepts="labels", bank=[dear.Description("a", "colour"), dear.Description("b"),
                                            dear.Description("c", "shape")])
    with pytest.raises(dear.DeARError, match="use clusters or labels"):
        dear.check(concepts="topics", bank=[])
    dear.check(concepts="clusters", bank=[dear.Description("b")])  # clusters need no label


# ---- description pools: the file format and its errors ---------------------------------------
def test_a_pool_file_skips_comments_and_blanks_keeps_the_first_of_a_repeat_and_reads_labels(tmp_path, capsys):
    path = tmp_path / "pool.txt"
    path.write_text("# my descriptions\n\nImage with a red color\ncolour\tignored?\nA striped shirt\ttexture\n"
                    "Image with a red color\n  A striped shirt  \n", encoding="utf-8")
    lines = []
    pool = read_descriptions(str(path), log=lines.append)
    assert pool == [dear.Description("Image with a red color"), dear.Description("colour", "ignored?"),
                    dear.Description("A striped shirt", "texture")]
    assert lines == [f"{path}: 3 distinct descriptions (2 repeated lines dropped)"]


@pytest.mark.parametrize("content, message", [
    (None, "no such description pool"),
    (b"\n# only a comment\n\n", "no descriptions in it"),
    (b"Image with a r\xe9d color\n", "not UTF-8 text; save the pool as UTF-8"),
])
def test_a_bad_pool_file_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "pool.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TrainError, match=message) as error:
        read_descriptions(str(path))
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


def test_the_picks_of_a_pool_without_labels_default_to_the_papers():
    assert dear.default_picks([dear.Description("a"), dear.Description("b")], ["colour"]) == dear.PAPER_PICKS
    assert dear.default_picks(project_bank(), dear.CORE_ATTRIBUTES) == 16  # labelled: fewest values


# ---- the record: roles.json and clusters.md -------------------------------------------------
def test_the_clusters_survive_the_role_file(tmp_path):
    heads = [dear.HeadRole(0, h, "generalization", None, 1.5, ["a", "b"], ["cluster 0", NOISE]) for h in range(2)]
    clusters = [dear.Cluster(0, "colour", 3, ["a", "c", "d"])]
    role_map = dear.RoleMap(1, 2, ["colour"], heads, 0.8, 1.3, concepts="clusters", clusters=clusters)
    role_map.save(str(tmp_path / "roles.json"))
    assert dear.RoleMap.load(str(tmp_path / "roles.json")) == role_map


def test_adjusted_rand_index_matches_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    generator = torch.Generator().manual_seed(0)
    for n, k, j in ((30, 3, 4), (50, 7, 2), (12, 12, 3), (9, 1, 3), (20, 2, 2)):
        a = torch.randint(0, k, (n,), generator=generator).tolist()
        b = torch.randint(0, j, (n,), generator=generator).tolist()
        assert reports.adjusted_rand_index(a, b) == pytest.approx(metrics.adjusted_rand_score(a, b), abs=1e-12)
    assert reports.adjusted_rand_index([0, 0, 1, 1], [5, 5, 2, 2]) == 1.0


def test_clusters_md_lists_each_cluster_and_its_agreement_with_the_labels():
    heads = [dear.HeadRole(0, 0, "attribute", "colour", 0.81, ["red", "blue", "green", "round"],
                           ["cluster 0", "cluster 0", "cluster 0", NOISE]),
             dear.HeadRole(0, 1, "generalization", None, 1.5, ["square", "round", "red", "dotted"],
                           ["cluster 1", NOISE, "cluster 0", "cluster 1"])]
    clusters = [dear.Cluster(0, "colour", 3, ["red", "blue", "green"]), dear.Cluster(1, "other", 2, ["square", "dotted"])]
    role_map = dear.RoleMap(1, 2, ["colour"], heads, 0.8, 1.3, concepts="clusters", clusters=clusters)
    pool = [("red", "colour"), ("blue", "colour"), ("green", "colour"), ("round", "shape"), ("square", "shape"),
            ("dotted", "texture")]
    text = reports.clusters_table(role_map, dict(pool), dict(name="clip"))
    assert "Embedded by CLIP's text tower." in text
    assert "| 0 | colour | 3 | red; blue; green |" in text and "| 1 | other | 2 | square; dotted |" in text
    assert "In no cluster (noise, each a concept of its own): 1 picks." in text
    found = ["cluster 0"] * 3 + ["noise round", "cluster 1", "cluster 1"]  # red blue green round square dotted
    truth = ["colour"] * 3 + ["shape", "shape", "texture"]
    assert f"adjusted Rand index {reports.adjusted_rand_index(found, truth):.2f}, purity 0.80" in text
    assert "clusters per concept: colour 1, shape 1, texture 1." in text


# ---- what the analysis hands the thresholds, and what it clusters --------------------------
def planted_analysis(clip, plan, bank, embed_texts, **options):
    """analyze_heads with TextSpan's picks planted head by head (layer-major), on 3 layers."""
    picks = iter(plan)
    fake_text = torch.nn.functional.normalize(torch.randn(len(bank), 32, generator=torch.Generator().manual_seed(0)),
                                              dim=-1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dear, "encode_descriptions", lambda clip, tok, texts: fake_text[:len(texts)])
        patch.setattr(dear, "textspan", lambda *args: next(picks))
        images = torch.randn(24, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        return dear.analyze_heads(clip, images, None, bank, num_layers=3, num_descriptions=6,
                                  log=lambda line: None, embed_texts=embed_texts, **options)


def two_groups_and_four_loners():
    """16 unlabelled phrases: two groups of 6 alike ones (HDBSCAN's two clusters) and 4 loners,
    each in a direction of its own (noise, as no 5 of them come together)."""
    bank = [dear.Description(f"phrase {k}") for k in range(16)]
    e, generator = torch.eye(32), torch.Generator().manual_seed(2)
    where = [e[0]] * 6 + [e[1]] * 6 + [e[2 + k] for k in range(4)]
    point = {entry.text: where[k] + 0.01 * torch.randn(32, generator=generator) for k, entry in enumerate(bank)}
    point.update({a: e[20 + k] for k, a in enumerate(dear.CORE_ATTRIBUTES)})  # the anchors: far from all
    calls = []

    def embed_texts(texts):
        calls.append(list(texts))
        return torch.stack([point[t] for t in texts])
    return bank, embed_texts, calls


# 12 heads of 6 picks: a specialist of each group, one head holding the 4 loners, the rest split 3 + 3;
# phrases 0-2 and 6-8 are picked by many heads.
PLAN = ([list(range(5, -1, -1)), list(range(6, 12)), [12, 13, 14, 15, 0, 6]]
        + [[0, 1, 2, 6, 7, 8] for _ in range(9)])


def test_the_thresholds_count_each_pick_in_no_cluster_as_a_concept_of_its_own(tiny_deep_clip):
    """2 clusters and 4 picks in none make 6 concepts: with 6 picks per head the thresholds are
    thirds of log2(6) bits (0.86, 1.72). Counting the clusters alone (2: 0.33, 0.67), the noise as
    one concept (3: the 0.81 floor, 1.06) or only the concepts the heads name gives others."""
    bank, embed_texts, _ = two_groups_and_four_loners()
    roles = planted_analysis(tiny_deep_clip, PLAN, bank, embed_texts, min_cluster_size=5)
    assert [c.size for c in roles.clusters] == [6, 6]
    assert roles.heads[2].concepts == [NOISE] * 4 + ["cluster 0", "cluster 1"]
    top = math.log2(6)
    assert (roles.low_bits, roles.high_bits) == pytest.approx((top / 3, 2 * top / 3))
    assert (roles.low_bits, roles.high_bits) == pytest.approx(dear.default_thresholds(6, 6))


def test_without_an_encoder_the_picks_are_the_banks_clip_rows_and_only_the_anchors_are_encoded(
        tiny_deep_clip, monkeypatch):
    """embed_texts None (CLIP's text tower): the clustering reads the picks' rows of the bank's
    embeddings, made once; only the attributes' names (the anchors of an unlabelled pool) are
    encoded again."""
    bank, embed_texts, _ = two_groups_and_four_loners()
    rows = embed_texts([entry.text for entry in bank])  # (16, 32): the bank as "CLIP" embeds it
    anchors = torch.eye(32)[20:25]  # each attribute's name, far from every phrase
    encoded, clustered, picks = [], [], iter(PLAN)
    monkeypatch.setattr(dear, "encode_descriptions", lambda clip, tok, texts:
                        encoded.append(list(texts)) or (rows if len(texts) == 16 else anchors))
    cluster_picks = dear.cluster_picks
    monkeypatch.setattr(dear, "cluster_picks", lambda texts, points, *rest:
                        clustered.append(points) or cluster_picks(texts, points, *rest))
    monkeypatch.setattr(dear, "textspan", lambda *args: next(picks))
    images = torch.randn(24, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    roles = dear.analyze_heads(tiny_deep_clip, images, None, bank, num_layers=3, num_descriptions=6,
                               concepts="clusters", min_cluster_size=5, log=lambda line: None)
    first_seen = list(dict.fromkeys(i for head in PLAN for i in head))
    assert encoded == [[entry.text for entry in bank], list(dear.CORE_ATTRIBUTES)]
    assert len(clustered) == 1 and torch.equal(clustered[0], rows[first_seen])
    assert [c.size for c in roles.clusters] == [6, 6]


def test_concepts_from_labels_count_every_label_of_the_bank_and_name_each_by_itself():
    """K is what a pick could fall on: the bank's 3 labels, though the picks name one; no encoder
    is asked and no cluster is made."""
    bank = [dear.Description("a red thing", "colour"), dear.Description("a blue thing", "colour"),
            dear.Description("a round thing", "shape"), dear.Description("a calm thing", "mood")]

    def no_encoder(texts):
        raise AssertionError("labels need no embedding")
    found = dear.find_concepts("labels", bank, [1, 0], ["colour", "shape"], no_encoder, 2)
    assert found == dear.Concepts(["colour", "colour"], {"colour": "colour", "shape": "shape", "mood": "mood"},
                                  3, [])


def test_each_distinct_pick_is_embedded_and_clustered_once(tiny_deep_clip, monkeypatch):
    """Phrases picked by several heads (0-2 and 6-8 by ten) are embedded once and are one point
    each of the clustering, in the order TextSpan first picked them."""
    bank, embed_texts, calls = two_groups_and_four_loners()
    clustered = []
    cluster_picks = dear.cluster_picks
    monkeypatch.setattr(dear, "cluster_picks", lambda texts, points, *rest:
                        clustered.append((list(texts), len(points))) or cluster_picks(texts, points, *rest))
    roles = planted_analysis(tiny_deep_clip, PLAN, bank, embed_texts, min_cluster_size=5)
    first_seen = [bank[i].text for i in dict.fromkeys(i for head in PLAN for i in head)]
    assert calls[0] == first_seen and len(first_seen) == 16  # the picks; calls[1]: the anchors
    assert clustered == [(first_seen, 16)]
    assert sum(c.size for c in roles.clusters) + 4 == 16  # each point once: 6 + 6 + 4 loners
