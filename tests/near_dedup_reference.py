"""The near-duplicate rule of raytrain.enrich in one process: the reference the Spark job's result is checked
against (tests) and the single-process baseline of benchmarks/bench_enrich.py. It uses the product's own MinHash, LSH
band keys, verification and clustering (raytrain.enrich.dedup), wired as plain Python instead of Spark groups."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

from raytrain.enrich.dedup import cluster_roots, lsh_band_keys, lsh_params, verified_pairs
from raytrain.errors import RaytrainError


def near_duplicate_groups(
    ids: Sequence[Hashable], signatures: np.ndarray, threshold: float, bands: int | None = None,
    rows: int | None = None,
) -> list[list]:
    """Clusters (each sorted, size >= 2) of ids whose signatures are near-duplicates.

    Candidates share an LSH band key; a candidate pair joins a cluster only if its estimated Jaccard is
    >= ``threshold`` (connected components, so clusters are transitive). ``bands``/``rows`` default to lsh_params.
    """
    sigs = np.asarray(signatures, dtype=np.uint32)
    if sigs.ndim != 2 or sigs.shape[0] != len(ids):
        raise RaytrainError(f"signatures must be (len(ids)={len(ids)}, num_perm), got {sigs.shape}")
    if len(set(ids)) != len(ids):
        raise RaytrainError("near_duplicate_groups: ids must be unique (drop exact duplicates first)")
    if bands is None or rows is None:
        bands, rows = lsh_params(threshold, sigs.shape[1])
    keys = lsh_band_keys(sigs, bands, rows)  # (N, B)
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, row_keys in enumerate(keys.tolist()):
        for k in row_keys:
            buckets[k].append(i)
    edges = [(members[i], members[j]) for members in buckets.values() if len(members) > 1
             for i, j, _ in verified_pairs(sigs[members], threshold)]
    a, b = (np.array(x, dtype=np.int64) for x in zip(*edges, strict=True)) if edges else (np.zeros(0, np.int64),) * 2
    roots = cluster_roots(a, b, len(ids))
    clusters: dict[int, list] = defaultdict(list)
    for i, root in enumerate(roots.tolist()):
        clusters[root].append(ids[i])
    return sorted((sorted(c) for c in clusters.values() if len(c) > 1), key=lambda c: c[0])


def near_duplicate_clusters(
    ids: Sequence[Hashable], signatures: np.ndarray, threshold: float, bands: int | None = None,
    rows: int | None = None,
) -> list:
    """The ids to drop as near-duplicates: every member of each cluster but its smallest id, sorted.

    In: unique, mutually comparable ids (uuids or ints), their MinHash signatures (N, num_perm), the Jaccard
    threshold. Out: sorted list of ids.
    """
    groups = near_duplicate_groups(ids, signatures, threshold, bands, rows)
    return sorted(i for g in groups for i in g[1:])
