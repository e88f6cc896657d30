"""clustering.hdbscan against scikit-learn's HDBSCAN (a test-only oracle, requirements-dev.txt): the same
partition on many point sets -- blobs of different density with noise, unit vectors in 64 to 512
dimensions, integer grids and repeated points where equal distances are everywhere -- and one-line
errors for bad settings.

    python -m pytest -q tests/test_hdbscan.py
"""

import os
import sys
import warnings

import numpy as np
import pytest
import torch
from sklearn.cluster import HDBSCAN

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dear  # noqa: E402
from clustering import ClusteringError, hdbscan  # noqa: E402


def sklearn_labels(x, m, s):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HDBSCAN(min_cluster_size=m, min_samples=s, metric="euclidean",
                        cluster_selection_method="eom", allow_single_cluster=False, copy=False)
        return model.fit(x).labels_


def same_partition(a, b):
    """Equal up to renaming the clusters; noise (-1) must match exactly."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or not np.array_equal(a == -1, b == -1):
        return False
    pairs = set(zip(a[a >= 0].tolist(), b[b >= 0].tolist()))
    return len(pairs) == len(set(a[a >= 0].tolist())) == len(set(b[b >= 0].tolist()))


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ---- point sets: (rng, n) -> (n, d) float64 ----
def blobs_2d(rng, n):  # three blobs of different densities plus uniform noise
    sizes = rng.multinomial(int(n * 0.8), [0.5, 0.3, 0.2])
    parts = [rng.normal(size=(k, 2)) * scale + rng.uniform(-8, 8, size=2)
             for k, scale in zip(sizes, (0.2, 0.6, 1.5))]
    return np.concatenate(parts + [rng.uniform(-10, 10, size=(n - sizes.sum(), 2))])


def sphere(d):  # random unit vectors
    return lambda rng, n: unit(rng.normal(size=(n, d)))


def sphere_clusters(d):  # unit vectors around a few random centres, each its own spread
    def make(rng, n):
        k = rng.integers(2, 6)
        centres, spreads = unit(rng.normal(size=(k, d))), rng.uniform(0.02, 0.12, size=k)
        which = rng.integers(0, k, size=n)
        return unit(centres[which] + rng.normal(size=(n, d)) * spreads[which, None])
    return make


def grid(rng, n):  # integer points in a small box: duplicates and equal distances everywhere
    return rng.integers(0, rng.integers(2, 7), size=(n, rng.integers(1, 4))).astype(np.float64)


def repeated(rng, n):  # a few unit vectors, each repeated many times, plus some singletons
    base = unit(rng.normal(size=(rng.integers(2, 6), 16)))
    x = base[rng.integers(0, len(base), size=n)]
    x[: n // 5] = unit(rng.normal(size=(n // 5, 16)))
    return x


SETS = {"blobs_2d": blobs_2d, "sphere64": sphere(64), "sphere_clusters64": sphere_clusters(64),
        "sphere_clusters128": sphere_clusters(128), "sphere512": sphere(512),
        "sphere_clusters512": sphere_clusters(512), "grid": grid, "repeated": repeated}
PARAMS = [(5, None), (2, 1), (3, 1), (4, 8), (10, 3), (15, None), (6, 20)]
CASES = [(name, seed, n, m, s) for name in SETS for seed, (n, (m, s)) in
         enumerate(zip((5, 12, 40, 120, 400, 90, 250), PARAMS))]


@pytest.mark.parametrize("name,seed,n,m,s", CASES)
def test_same_partition_as_sklearn(name, seed, n, m, s):
    x = SETS[name](np.random.default_rng(seed), n)
    ours = hdbscan(torch.from_numpy(x), m, s)
    assert ours.dtype == torch.long and ours.shape == (n,)
    if n < (m if s is None else s):  # sklearn raises here; we call it all noise
        with pytest.raises(ValueError):
            sklearn_labels(x, m, s)
        assert (ours == -1).all()
        return
    theirs = sklearn_labels(x, m, s)
    assert same_partition(ours.numpy(), theirs), (ours.tolist(), theirs.tolist())
    assert sorted(set(ours.tolist()) - {-1}) == list(range(len(set(ours.tolist()) - {-1})))


@pytest.mark.parametrize("seed", range(6))
def test_grid_ties_many_params(seed):
    rng = np.random.default_rng(100 + seed)
    x = grid(rng, int(rng.integers(30, 200)))
    for m, s in [(2, None), (3, 2), (4, 1), (5, 9), (8, 4)]:
        assert same_partition(hdbscan(torch.from_numpy(x), m, s).numpy(), sklearn_labels(x, m, s))


def test_all_points_equal():
    x = np.zeros((12, 3))
    for m, s in [(2, None), (3, 1), (5, 5)]:
        assert same_partition(hdbscan(torch.from_numpy(x), m, s).numpy(), sklearn_labels(x, m, s))


def test_tiny_sets():
    rng = np.random.default_rng(7)
    for n in range(2, 8):
        for m, s in [(2, None), (2, 1), (3, 2)]:
            x = rng.normal(size=(n, 2))
            ours = hdbscan(torch.from_numpy(x), m, s).numpy()
            assert same_partition(ours, sklearn_labels(x, m, s))
    assert hdbscan(torch.ones(1, 4), 2, 1).tolist() == [-1]  # sklearn refuses n = 1


def test_fewer_points_than_min_samples_is_all_noise():  # sklearn raises; we say: no dense point
    x = np.random.default_rng(8).normal(size=(6, 3))
    with pytest.raises(ValueError, match="min_samples"):  # scikit-learn's own error
        sklearn_labels(x, 3, 7)
    assert hdbscan(torch.from_numpy(x), 3, 7).tolist() == [-1] * 6


def test_float32_input_and_input_untouched():
    x = torch.from_numpy(blobs_2d(np.random.default_rng(3), 150)).float()
    before = x.clone()
    ours = hdbscan(x, 5)
    assert torch.equal(x, before)
    assert same_partition(ours.numpy(), sklearn_labels(x.numpy(), 5, None))


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(5, 2), 1), "min_cluster_size"),
    ((torch.zeros(5, 2), 2.0), "min_cluster_size"),
    ((torch.zeros(5, 2), True), "min_cluster_size"),
    ((torch.zeros(5, 2), 2, 0), "min_samples"),
    ((torch.zeros(5, 2), 2, False), "min_samples"),
    ((torch.zeros(5, 2), 2, 1.5), "min_samples"),
    ((torch.zeros(5), 2), "points"),
    ((torch.zeros(2, 3, 4), 2), "points"),
    ((torch.zeros(0, 3), 2), "points"),
    ((torch.zeros(3, 0), 2), "points"),
    ((torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), 2), "points"),
    ((torch.tensor([[0.0, 1.0], [float("inf"), 0.0]]), 2), "points"),
])
def test_bad_input(args, match):
    with pytest.raises(ClusteringError, match=match) as info:
        hdbscan(*args)
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(dear.DeARError, match=match) as again:  # dear.py's view: the same line
        dear.hdbscan(*args)
    assert str(again.value) == str(info.value)
