"""TextSpan as its authors wrote it, and the guard on how many picks it makes.

The authors' algorithm is yossigandelsman/clip_text_span, compute_complete_text_set.py,
`replace_with_iterative_removal`. `authors_textspan` below is that algorithm written out
again in our own words (NumPy, float64), step for step: the SVD of the *raw* contributions,
the texts projected onto the top `rank` right singular vectors (through the projector
V^T (V V^T)^-1 V, as they write it), the data centred only then, and the greedy picks that
divide by the picked text's squared norm. dear.textspan must pick exactly what it picks, in
the same order, on inputs where centring first (dear.textspan before this test) picks
otherwise.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import clip_model
import dear
from harness.bank import project_bank
from conftest import TINY
from dear import DeARError


def authors_textspan(data: np.ndarray, texts: np.ndarray, iters: int, rank: int) -> list:
    data, texts = np.asarray(data, np.float64), np.asarray(texts, np.float64)
    _, _, vh = np.linalg.svd(data, full_matrices=False)  # of the raw data, not centred
    vh = vh[:rank]
    texts = (vh.T @ np.linalg.inv(vh @ vh.T) @ vh @ texts.T).T  # each text inside the span
    data = data - data.mean(axis=0, keepdims=True)  # centred after the projection
    picks = []
    for _ in range(iters):
        spread = (data @ texts.T).std(axis=0, ddof=1)  # torch's std, as theirs: unbiased
        best = int(np.argmax(spread))
        picks.append(best)
        text = texts[best]
        squared_norm = text @ text
        data = data - np.outer(data @ text / squared_norm, text)
        texts = texts - np.outer(texts @ text / squared_norm, text)
    return picks


def centred_first_textspan(data: np.ndarray, texts: np.ndarray, iters: int, rank: int) -> list:
    """What dear.textspan did before: centre, then the SVD, rank min(rank, n - 1, E)."""
    data = np.asarray(data, np.float64)
    data = data - data.mean(axis=0, keepdims=True)
    r = min(rank, data.shape[0] - 1, data.shape[1])
    _, _, vh = np.linalg.svd(data, full_matrices=False)
    texts = np.asarray(texts, np.float64) @ vh[:r].T @ vh[:r]
    picks = []
    for _ in range(iters):
        spread = (data @ texts.T).std(axis=0, ddof=1)
        spread[picks] = -1.0
        best = int(np.argmax(spread))
        picks.append(best)
        direction = texts[best] / np.linalg.norm(texts[best])
        data = data - np.outer(data @ direction, direction)
        texts = texts - np.outer(texts @ direction, direction)
    return picks


def head_and_bank(width: int, structured: bool, n_images: int = 120, n_texts: int = 300, seed: int = 0):
    """A head's contributions (float32, as the analysis hands them over) and a normalised bank.
    Every head has a mean (an offset all images share, as real heads do); a structured head
    also writes along five of the bank's texts with falling strengths."""
    rng = np.random.default_rng([width, structured, n_images, seed])
    bank = rng.standard_normal((n_texts, width))
    bank /= np.linalg.norm(bank, axis=1, keepdims=True)
    data = 0.3 * rng.standard_normal((n_images, width)) + 0.5 * rng.standard_normal(width)
    if structured:
        for strength, text in zip((5.0, 3.0, 2.0, 1.5, 1.0), (7, 40, 99, 150, 201)):
            data += strength * rng.standard_normal((n_images, 1)) * bank[text]
    return data.astype(np.float32), bank.astype(np.float32)


# (width, rank, structured, images): widths 64..512, ranks 20 and 80, heads with and without
# structure, and pools smaller than the rank (where the span is every image's direction).
CASES = [(w, r, s, 120) for w in (64, 128, 256, 512) for r in (20, 80) for s in (False, True)]
CASES += [(256, 80, False, 30), (512, 80, True, 30)]


def parted_at(a: list, b: list):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("width, rank, structured, n_images", CASES)
def test_textspan_picks_what_the_authors_algorithm_picks(width, rank, structured, n_images):
    data, bank = head_and_bank(width, structured, n_images)
    ours = dear.textspan(torch.from_numpy(data), torch.from_numpy(bank), num_descriptions=20, rank=rank)
    theirs = authors_textspan(data, bank, 20, rank)
    assert ours == theirs, f"picks part at pick {parted_at(ours, theirs)}"
    if structured:  # the planted texts come first, strongest first
        assert ours[:5] == [7, 40, 99, 150, 201]


def test_the_comparison_can_fail_centring_first_picks_otherwise():
    """The inputs above tell the two variants apart: without this the test could not fail."""
    parted = []
    for width, rank, structured, n_images in CASES:
        data, bank = head_and_bank(width, structured, n_images)
        parted.append(parted_at(centred_first_textspan(data, bank, 20, rank), authors_textspan(data, bank, 20, rank)))
    assert sum(p is not None for p in parted) >= len(CASES) // 2, parted


def test_a_pool_smaller_than_the_rank_spans_every_image_not_one_less():
    # 12 images: the raw contributions have rank 12 and TextSpan can make 12 picks (centring
    # first, it was 11); the 12th is the authors' too.
    data, bank = head_and_bank(64, True, n_images=12)
    ours = dear.textspan(torch.from_numpy(data), torch.from_numpy(bank), num_descriptions=12, rank=80)
    assert ours == authors_textspan(data, bank, 12, 80)
    with pytest.raises(DeARError, match="rank <= 12"):
        dear.textspan(torch.from_numpy(data), torch.from_numpy(bank), num_descriptions=13, rank=80)


# ------------------------------------------------------------------------------------------
# How many picks: the default, and what is refused
# ------------------------------------------------------------------------------------------


def test_the_default_is_capped_by_what_the_span_can_explain():
    assert dear.analysis_picks(None, 591, 2000, rank=80, default=dear.PAPER_PICKS) == 20
    assert dear.analysis_picks(None, 591, 2000, rank=80, default=16) == 16
    with pytest.warns(UserWarning, match=r"TextSpan makes 10 picks per head, not the default 20: .*rank <= 10"):
        assert dear.analysis_picks(None, 591, 10, rank=80, default=20) == 10  # EuroSAT 1-shot: 10 images
    with pytest.warns(UserWarning, match="the bank has 15 descriptions"):
        assert dear.analysis_picks(None, 15, 2000, rank=80, default=20) == 15


def test_a_request_the_span_supports_is_kept_up_to_the_limit():
    assert dear.analysis_picks(7, 591, 12, rank=80, default=20) == 7
    assert dear.analysis_picks(12, 591, 12, rank=80, default=20) == 12  # rank <= images, not images - 1
    assert dear.analysis_picks(80, 591, 2000, rank=80, default=20) == 80  # TextSpan's rank
    assert dear.analysis_picks(32, 591, 2000, rank=80, default=20, embed_dim=32) == 32


@pytest.mark.parametrize("requested, bank, images, extra, message", [
    (100000, 591, 2000, {}, r"--descriptions 100000: .*1\.\.80 picks .*TextSpan keeps 80 singular directions"),
    (600, 591, 5000, {"rank": 1000}, r"--descriptions 600: .*1\.\.591 picks .*the bank has 591 descriptions"),
    (13, 591, 12, {}, r"--descriptions 13: .*1\.\.12 picks .*rank <= 12.* more images"),
    (33, 591, 2000, {"embed_dim": 32}, r"--descriptions 33: .*the embedding has 32 dimensions"),
    (0, 591, 2000, {}, r"--descriptions 0: .*1\.\.80"),
    (-3, 591, 2000, {}, r"--descriptions -3"),
    (5, 591, 1, {}, r"1 image\(s\); .* at least 2"),
    (None, 591, 1, {}, r"1 image\(s\); .* at least 2"),
    (5, 591, 2000, {"rank": 0}, r"rank=0: .*use 1 or more"),
])
def test_a_request_the_span_cannot_support_is_refused_in_one_line(requested, bank, images, extra, message):
    with pytest.raises(DeARError, match=message) as error:
        dear.analysis_picks(requested, bank, images, **{"rank": 80, "default": 20, **extra})
    assert "\n" not in str(error.value)


def test_analyze_heads_checks_the_picks_before_it_encodes_a_text(tiny_clip, monkeypatch):
    R = TINY["image_resolution"]
    images = torch.randn(8, 3, R, R, generator=torch.Generator().manual_seed(0))
    quiet = dict(num_layers=2, log=lambda line: None)
    with pytest.raises(DeARError, match="--descriptions 9: .*rank <= 8"):  # tokenizer None: never reached
        dear.analyze_heads(tiny_clip, images, None, project_bank(), num_descriptions=9, **quiet)
    bank = project_bank()
    texts = F.normalize(torch.randn(len(bank), TINY["embed_dim"], generator=torch.Generator().manual_seed(1)), dim=-1)
    monkeypatch.setattr(dear, "encode_descriptions", lambda clip, tokenizer, phrases: texts)
    with pytest.warns(UserWarning, match="TextSpan makes 8 picks per head, not the default 16"):
        roles = dear.analyze_heads(tiny_clip, images, None, bank, **quiet)
    assert all(len(h.descriptions) == 8 for h in roles.heads)
    roles = dear.analyze_heads(tiny_clip, images, None, bank, num_descriptions=8, **quiet)
    assert all(len(h.descriptions) == 8 for h in roles.heads)


def test_a_rank_above_the_heads_width_removes_a_pick_only_in_part_and_picks_its_twin_again():
    # A head writing into 4 of 64 dimensions: strongly along u1, less along u2. Two phrases say
    # u1 (each with its own part outside the head's span), one says u2. With the span's true rank
    # the first pick takes u1 out entirely and the second is u2; with the whole space (rank 80,
    # as for a 64-wide ViT-B/16 head) the removed direction leans outside the span, half of u1
    # stays, and its twin phrase is picked again.
    e, generator = torch.eye(64), torch.Generator().manual_seed(0)
    data = torch.randn(300, 4, generator=generator) @ (torch.tensor([5.0, 2.0, 0.1, 0.1])[:, None] * e[:4])
    bank = F.normalize(torch.stack([e[0] + e[10], e[0] + e[20], e[1] + e[30], e[40], e[2] + e[50]]), dim=-1)
    assert dear.textspan(data, bank, num_descriptions=2, rank=4) == [0, 2]
    assert dear.textspan(data, bank, num_descriptions=2, rank=80) == [0, 1]


def test_analyze_heads_takes_textspans_rank_from_the_heads_width(monkeypatch):
    # 8 heads of 8 channels writing into a 32-dimensional embedding: rank 8, not 80 (nor 32).
    torch.manual_seed(0)
    clip = clip_model.CLIP(**dict(TINY, vision_width=64, vision_heads=8)).eval()
    assert dear.textspan_rank(clip) == 8
    R, bank = TINY["image_resolution"], project_bank()
    images = torch.randn(40, 3, R, R, generator=torch.Generator().manual_seed(0))
    texts = F.normalize(torch.randn(len(bank), TINY["embed_dim"], generator=torch.Generator().manual_seed(1)), dim=-1)
    monkeypatch.setattr(dear, "encode_descriptions", lambda clip, tokenizer, phrases: texts)
    roles = dear.analyze_heads(clip, images, None, bank, num_layers=2, num_descriptions=6, log=lambda line: None)
    parts = clip_model.head_contributions(clip, images, 2)
    contributions = parts.heads / parts.total().norm(dim=-1)[:, None, None, None]  # (n, L, H, E)
    by_rank = {rank: [[bank[i].text for i in dear.textspan(contributions[:, h.layer - 1, h.head], texts, 6, rank)]
                      for h in roles.heads] for rank in (8, 80)}
    assert [h.descriptions for h in roles.heads] == by_rank[8]
    assert by_rank[8] != by_rank[80], "the two ranks pick alike here: the test could not tell them apart"
