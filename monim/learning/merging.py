"""Greedy Merging (He et al. 2021), the paper's datastore-compression baseline.

After a day is scored, each of its new entries, in random order, looks up its k = 9 nearest
entries (the memory so far and the day's other new entries); every neighbour with the same value
and weight exactly 1 is removed and its weight added to the entry. At inference log(weight) is
added to a neighbour's score -d/T before the softmax (`Memory.search`'s prior). The removals and
weights are committed with the day in one manifest rename (`Datastore.commit_day`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import faiss
import numpy as np

from monim.storage.entries import Entries

if TYPE_CHECKING:
    from monim.theta.memory import Memory


def greedy_merge(memory: Memory, entries: Entries, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge a day's new entries into each other and into the memory: (keep [n] bool: the new
    entries kept, weights [kept] int32: their weights, merged: ids of older entries absorbed)."""
    n = len(entries)
    if n == 0:
        return np.zeros(0, bool), np.zeros(0, np.int32), np.zeros(0, np.int64)
    keys, base = entries.keys.astype(np.float32), memory.ds.manifest["next_id"]  # new entry j is id base + j
    new_d, new_j = faiss.knn(keys, keys, min(k + 1, n))  # k others, and the entry itself
    new_d[new_j == np.arange(n)[:, None]] = np.inf
    found = [(new_d, np.where(new_j >= 0, new_j + base, -1))]
    if len(memory):
        found.append(memory.nearest(keys, k))
    dist, ids = (np.concatenate(parts, axis=1) for parts in zip(*found))
    order = np.argsort(dist, axis=1, kind="stable")[:, :k]
    ids = np.where(np.isfinite(np.take_along_axis(dist, order, 1)), np.take_along_axis(ids, order, 1), -1)
    old_values, old_weights = memory.ds.shards.values_by_id(), memory.ds.shards.weights_by_id()
    removed, weights, merged = np.zeros(n, bool), np.ones(n, np.int64), set()
    for i in rng.permutation(n):
        if removed[i]:
            continue
        for c in ids[i]:
            if c >= base:
                j = c - base
                if removed[j] or weights[j] != 1 or entries.values[j] != entries.values[i]:
                    continue
                removed[j] = True
            elif c >= 0:
                if c in merged or old_values[c] != entries.values[i] or (old_weights is not None and old_weights[c] != 1):
                    continue
                merged.add(int(c))
            else:
                continue
            weights[i] += 1
    return ~removed, weights[~removed].astype(np.int32), np.array(sorted(merged), np.int64)
