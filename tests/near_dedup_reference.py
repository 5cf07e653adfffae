"""The near-duplicate rule of raytrain.enrich in one process: the reference the Spark job's result is checked
against (tests) and the single-process baseline of benchmarks/bench_enrich.py. It uses the product's own MinHash, LSH
band keys and verification (raytrain.enrich.dedup), wired as plain Python instead of Spark groups."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

from raytrain.enrich.dedup import lsh_band_keys, lsh_params, verified_pairs
from raytrain.errors import RaytrainError


def _verified_edges(ids: Sequence[Hashable], signatures: np.ndarray, threshold: float, bands: int | None,
                    rows: int | None) -> list[tuple[int, int]]:
    """(i, j), i < j, positions in ``ids`` of the pairs that share an LSH band key and whose estimated Jaccard is
    >= ``threshold``."""
    sigs = np.asarray(signatures, dtype=np.uint32)
    if sigs.ndim != 2 or sigs.shape[0] != len(ids):
        raise RaytrainError(f"signatures must be (len(ids)={len(ids)}, num_perm), got {sigs.shape}")
    if len(set(ids)) != len(ids):
        raise RaytrainError("near-duplicate reference: ids must be unique (drop exact duplicates first)")
    if bands is None or rows is None:
        bands, rows = lsh_params(threshold, sigs.shape[1])
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, row_keys in enumerate(lsh_band_keys(sigs, bands, rows).tolist()):  # (N, B)
        for k in row_keys:
            buckets[k].append(i)
    return sorted({(members[i], members[j]) for members in buckets.values() if len(members) > 1
                   for i, j, _ in verified_pairs(sigs[members], threshold)})


def near_duplicate_groups(
    ids: Sequence[Hashable], signatures: np.ndarray, threshold: float, bands: int | None = None,
    rows: int | None = None,
) -> list[list]:
    """Connected components (each sorted, size >= 2) of the verified near-duplicate pairs of ``ids``: which rows
    are similar at all (the sample's planted pairs are checked with it). ``bands``/``rows`` default to lsh_params."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    edges = _verified_edges(ids, signatures, threshold, bands, rows)
    if not edges:
        return []
    a, b = (np.array(x, dtype=np.int64) for x in zip(*edges, strict=True))
    _, labels = connected_components(coo_matrix((np.ones(len(a)), (a, b)), shape=(len(ids), len(ids))),
                                     directed=False)
    clusters: dict[int, list] = defaultdict(list)
    for i, label in enumerate(labels.tolist()):
        clusters[label].append(ids[i])
    return sorted((sorted(c) for c in clusters.values() if len(c) > 1), key=lambda c: c[0])


def near_duplicates_in_order(
    ids: Sequence[Hashable], signatures: np.ndarray, threshold: float, bands: int | None = None,
    rows: int | None = None,
) -> list:
    """The ids to drop as near duplicates, ``ids`` given in input order: every row that has a verified pair with a
    row before it (the enrichment's rule, raytrain.enrich.passes.duplicates), in input order."""
    later = {j for _, j in _verified_edges(ids, signatures, threshold, bands, rows)}
    return [ids[j] for j in sorted(later)]
