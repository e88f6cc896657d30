"""clustering.py -- HDBSCAN written out (Campello, Moulavi, Sander 2013; McInnes et al. 2017),
the clustering that DeAR's head analysis runs on the heads' picked descriptions (dear.py's
section 2, cluster_picks; paper Sec. 3.2: the picks clustered, each cluster a concept).

It holds one function, hdbscan(points, min_cluster_size, min_samples) -> each point's cluster id
(-1: noise), and two helpers: a union-find root and the points under a tree node. It follows
sklearn.cluster.HDBSCAN step by step and gives the same partition, ties included
(tests/test_hdbscan.py checks it against scikit-learn).
It stands alone: torch and numpy only (numpy's argsort decides the ties as scikit-learn's does).
Bad input raises ClusteringError (a ValueError), one line; dear.py re-raises it as DeARError.
Copy it beside dear.py to cluster; without it dear.py runs everything but the clustering.
"""

from __future__ import annotations

import math
from collections import deque
from numbers import Integral
from typing import Optional

import numpy as np  # torchvision's own dependency: numpy's sort order, for HDBSCAN's ties
import torch


class ClusteringError(ValueError):
    """Bad input to hdbscan (a size, the points' shape or values): one line naming it."""


def hdbscan(points: torch.Tensor, min_cluster_size: int,
            min_samples: Optional[int] = None) -> torch.Tensor:
    """HDBSCAN (Campello, Moulavi, Sander 2013; McInnes et al. 2017): single linkage over a distance
    that pushes sparse points apart, then the clusters that persist longest as density rises.

    Follows sklearn.cluster.HDBSCAN step by step (Euclidean, its default algorithm, "eom", no single
    root cluster, epsilon 0, alpha 1) and gives the same partition, ties included.

    points: (n, d) float tensor, any scale.
    min_cluster_size: the fewest points (>= 2) that make a cluster.
    min_samples: neighbours, itself counted, that make a point dense (None: min_cluster_size).
    Returns: (n,) int64 tensor of cluster ids 0..k-1, -1 for noise.
    """
    m, s = min_cluster_size, (min_cluster_size if min_samples is None else min_samples)
    if not isinstance(m, Integral) or isinstance(m, bool) or m < 2:
        raise ClusteringError(f"min_cluster_size={m!r}: use an integer of 2 or more")
    if not isinstance(s, Integral) or isinstance(s, bool) or s < 1:
        raise ClusteringError(f"min_samples={s!r}: use an integer of 1 or more, or None")
    x = torch.as_tensor(points).detach().to("cpu", torch.float64)  # (n, d), as sklearn: float64
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ClusteringError(f"points has shape {tuple(x.shape)}: "
                              "pass an (n, d) tensor, n, d >= 1")
    if not torch.isfinite(x).all():
        raise ClusteringError("points holds nan or inf: drop or fix those rows first")
    n, d = x.shape
    if n < s or n == 1:  # sklearn raises here; no point has s neighbours: no density, all noise
        return torch.full((n,), -1, dtype=torch.long)

    # 1. Distances, (n, n), bit-equal to sklearn's, as the ties below hang on the last bit: squares
    #    summed one dimension at a time like its C loop, then numpy's sqrt, because torch's float64
    #    sqrt is not correctly rounded on some CPUs (1 ulp off for ~1% of values) and C's is.
    squared, diff = torch.zeros(n, n, dtype=torch.float64), torch.empty(n, n, dtype=torch.float64)
    for col in x.T.contiguous():  # col: (n,), one coordinate of every point (contiguous: faster)
        torch.sub(col[:, None], col[None, :], out=diff)  # (n, n), in place: no allocation per dim
        squared += diff.square_()
    dist = torch.from_numpy(np.sqrt(squared.numpy()))

    # 2. Core distance, (n,): distance to the s-th nearest point, the point itself counted first.
    core = dist.kthvalue(s, dim=1).values
    # 3. Mutual reachability, (n, n): max(core_i, core_j, dist_ij). Sparse points move away.
    reach = torch.maximum(dist, torch.maximum(core[:, None], core[None, :]))

    # 4. Minimum spanning tree by Prim's, as sklearn's default path (`mst_from_data_matrix`): each
    #    step adds the outside point nearest the tree (lowest index at ties, as argmin gives),
    #    joined to the tree point that first came that near (updates only on strictly nearer).
    in_tree = torch.zeros(n, dtype=torch.bool)
    nearest = torch.full((n,), math.inf, dtype=torch.float64)  # (n,) each point's reach to the tree
    source = torch.zeros(n, dtype=torch.long)  # (n,) the tree point giving it
    edges, new = [], 0  # edges: (tree point, new point, weight) in the order added
    for _ in range(n - 1):
        in_tree[new] = True
        nearer = (reach[new] < nearest) & ~in_tree
        nearest[nearer] = reach[new][nearer]
        source[nearer] = new
        new = int(nearest.masked_fill(in_tree, math.inf).argmin())
        edges.append((int(source[new]), new, float(nearest[new])))

    # 5. Edges by weight. Ties are common (many edges weigh exactly some point's core distance) and
    #    their order shapes the tree. sklearn sorts with numpy's default argsort, which is not
    #    stable (its tie order can depend on the CPU's SIMD sort); calling that same function on
    #    the same weights in the same order reproduces it exactly, so numpy here, not torch.
    order = np.argsort(np.array([w for _, _, w in edges], dtype=np.float64))

    # 6. Single-linkage tree: merge i joins the groups holding the ends of the i-th lightest edge
    #    into node n + i; left holds the edge's tree end, as sklearn's. size: points under a node.
    up = list(range(2 * n - 1))  # union-find parent of each node, a root points to itself
    size = [1] * n + [0] * (n - 1)
    merges = []  # (left, right, distance), merge i is node n + i
    for i, e in enumerate(order.tolist()):
        a, b, w = edges[e]
        left, right = _root(up, a), _root(up, b)
        up[left] = up[right] = n + i
        size[n + i] = size[left] + size[right]
        merges.append((left, right, w))

    # 7. Condensed tree, walking merges from the top, breadth first as sklearn; lambda = 1 / dist,
    #    inf at 0 (duplicates). A side with under m points falls out of the cluster as points;
    #    if both have m or more, the cluster ends and two are born, with ids n + 1, n + 2, ...
    #    in birth order (so a parent's id is below its children's, which steps 9 and 10 use).
    rows = []  # (parent cluster, child cluster or point, lambda, child size)
    cluster_of, next_id = {2 * n - 2: n}, n + 1  # node -> cluster; the root node is cluster n
    queue = deque([2 * n - 2])
    while queue:
        node = queue.popleft()
        left, right, w = merges[node - n]
        lam = 1.0 / w if w > 0 else math.inf
        parent = cluster_of[node]
        splits = size[left] >= m and size[right] >= m
        for child in (left, right):
            if size[child] < m:
                rows += [(parent, p, lam, 1) for p in _points_under(merges, child, n)]
                continue
            if splits:
                cluster_of[child], next_id = next_id, next_id + 1
                rows.append((parent, cluster_of[child], lam, size[child]))
            else:
                cluster_of[child] = parent  # the same cluster, a few points lighter
            queue.append(child)

    # 8. Stability, sum over a cluster's rows of (lambda - its birth lambda) * size, added row by
    #    row in sklearn's order so equal stabilities stay bit-equal (inf - inf gives nan as there).
    birth = {n: 0.0, **{child: lam for _, child, lam, _ in rows if child >= n}}
    stability = dict.fromkeys(range(n, next_id), 0.0)
    for parent, _, lam, count in rows:
        stability[parent] += (lam - birth[parent]) * count

    # 9. Excess of mass, leaves first (larger ids): a cluster is chosen unless its children's summed
    #    stability is strictly larger, which then stands as its own. The root is never a candidate
    #    (no single cluster); nan (see 8) compares False, so a nan cluster is chosen, as in sklearn.
    parent_of = {child: parent for parent, child, _, _ in rows}  # points and clusters alike
    below = dict.fromkeys(range(n, next_id), 0.0)  # summed stability of each cluster's children
    chosen = set()
    for c in range(next_id - 1, n, -1):
        if below[c] > stability[c]:
            stability[c] = below[c]
        else:
            chosen.add(c)
        below[parent_of[c]] += stability[c]

    # 10. Labels. A point belongs to the topmost chosen cluster above it (chosen ones below that are
    #     dropped), else it is noise, whatever lambda it left at (sklearn checks lambdas only for a
    #     single root cluster, off here). Ids 0..k-1 in cluster-id order, as sklearn numbers them.
    top = {n: None}  # cluster -> the topmost chosen cluster at or above it, None if there is none
    for c in range(n + 1, next_id):  # a parent's id is below its children's: parents come first
        above = top[parent_of[c]]
        top[c] = above if above is not None else (c if c in chosen else None)
    winner = [top[parent_of[p]] for p in range(n)]  # (n,) each point's cluster, None: noise
    ids = {c: i for i, c in enumerate(sorted(set(winner) - {None}))}
    return torch.tensor([ids.get(c, -1) for c in winner], dtype=torch.long)  # None -> -1


def _root(up, i):
    """The root of i's group in the union-find `up`, halving the path on the way."""
    while up[i] != i:
        up[i] = up[up[i]]
        i = up[i]
    return i


def _points_under(merges, node, n):
    """The points (ids < n) below a node of the single-linkage tree."""
    stack, found = [node], []
    while stack:
        v = stack.pop()
        if v < n:
            found.append(v)
        else:
            stack += merges[v - n][:2]
    return found
