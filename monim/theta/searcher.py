"""A memory's entries searched as Θ reads them: up to its day (`as_of`), within the recency
rule's maximum age, through its FAISS index (brought up to the committed entries) or exactly from
the stored keys; each neighbour's value, age and prior weight. A Memory owns one.
"""

from __future__ import annotations

import datetime as dt
import functools
import os

import faiss
import numpy as np
import torch

from monim.core.lock import Locked, hold
from monim.core.manifest import CommittedDay
from monim.core.recency import Recency
from monim.storage.datastore import Datastore
from monim.storage.index import MemoryIndex
from monim.storage.parts import Parts, merge
from monim.storage.torch_search import values_of


class Searcher:
    """The entries of a memory, searched as Θ reads them."""

    def __init__(self, ds: Datastore, index: MemoryIndex, as_of: str | None, recency: Recency, parts: Parts | None = None):
        self.ds, self.index, self.as_of, self.recency = ds, index, as_of, recency
        self.parts = parts or Parts(ds.root, index.d, index.cfg)

    @property
    def split(self) -> bool:
        """Whether the memory is searched in parts (monim.storage.parts), not through one index."""
        return self.parts.split(self.ds)

    def current(self) -> bool:
        """Whether the index (every part's) holds the committed entries."""
        return self.parts.current(self.ds) if self.split else self.index.current(self.ds)

    def sync(self, retrain: bool = False) -> dict:
        """Bring the index up to the committed entries (detects a stale or missing index). It is
        saved unless another process is writing this memory (a reader never waits). A current
        index takes no lock: readers score with it many times a day."""
        if self.current() and not retrain:
            return self._sync(save=False)  # nothing to write (a reader may be on a read-only mount)
        if not os.access(self.ds.root, os.W_OK):  # a read-only mount: search an index synced here, save nothing
            return self._sync(retrain, save=False)
        try:
            with hold(self.ds.lock, wait=False):
                return self._sync(retrain)
        except Locked:
            return self._sync(retrain, save=False)

    def _sync(self, retrain: bool = False, save: bool = True) -> dict:
        """The index (or each part's, the whole memory's then let go) brought up to the committed entries."""
        if not self.split:
            return self.index.sync(self.ds, retrain, save)
        stats = self.parts.sync(self.ds, retrain, save)
        if save:
            self.index.drop()
        return stats

    def part_searchers(self, limits: dict) -> list[Searcher]:
        """A Searcher of the days and index of each part that may hold entries within a search's `limits`
        (the whole memory's: `limits`)."""
        return [Searcher(self.parts.view(self.ds, name), self.parts.index(name), None, Recency(), self.parts)
                for name in self.parts.within(self.ds, limits["above"], limits["below"])]

    @property
    def days(self) -> list[CommittedDay]:
        """The committed days this memory holds (up to `as_of`)."""
        return self.ds.days_at(self.as_of)

    @functools.cached_property
    def _below(self) -> int | None:
        """With `as_of` before the last day: the first entry id learned after it (ids grow by day)."""
        days = self.days
        if len(days) == len(self.ds.days):
            return None
        ids = [int(self.ds.shards.shard(d.shard, "ids")[-1]) for d in days if d.entries]
        return max(ids) + 1 if ids else 0

    @property
    def today(self) -> dt.date | None:
        """The memory's last day (as of `as_of`): where the ages of its entries are counted from."""
        days = self.days
        return dt.date.fromisoformat(days[-1].date) if days else None

    def _recent_days(self) -> list[CommittedDay] | None:
        """The days (with entries) within the recency rule's maximum age; None: every day."""
        today = self.today
        oldest = self.recency.oldest(today) if today is not None else None
        return None if oldest is None else [d for d in self.days if d.date >= oldest.isoformat() and d.entries]

    def _above(self, kept: list[CommittedDay] | None) -> int:
        """The first entry id the recency rule lets Θ search (0: all), given the days it keeps (`_recent_days`)."""
        if kept is None:
            return 0
        return int(self.ds.shards.shard(kept[0].shard, "ids")[0]) if kept else self.ds.manifest["next_id"]

    def _search_recent(self, kept: list[CommittedDay], keys: np.ndarray, k: int, below: int | None,
                       exclude: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Exact search over the entries of the days within the maximum age (`kept`), from their stored
        keys: an IVF-PQ index probes its nprobe lists, where a narrow window may hold few of them or none."""
        ids = np.concatenate([self.ds.shards.shard(d.shard, "ids") for d in kept] or [np.zeros(0, np.int64)])
        keep = np.ones(len(ids), bool) if below is None else ids < below
        if exclude is not None:
            keep &= ~np.isin(ids, exclude)
        dist, found = np.full((len(keys), k), np.inf, np.float32), np.full((len(keys), k), -1, np.int64)
        if keep.any():
            xb = np.concatenate([self.ds.shards.shard(d.shard, "keys") for d in kept])[keep].astype(np.float32)
            n = min(k, len(xb))
            dist[:, :n], rows = faiss.knn(np.ascontiguousarray(keys, dtype=np.float32), xb, n)
            found[:, :n] = ids[keep][rows]
        return dist, found

    def nearest(self, keys: np.ndarray, k: int | None = None, below: int | None = None,
                exclude: np.ndarray | None = None, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances and ids of each key's k nearest entries (id -1: none), among the entries
        up to `as_of` (or with id < `below`), within the recency rule's maximum age and not in
        `exclude`. With `exact`, IVF-PQ's candidates are re-ranked with the stored keys (its
        distances are approximate: a memorized context does not sit at 0)."""
        self.ready()
        limits = self.limits(k, below)
        if not self.split:
            return self.answer(keys, exclude=exclude, exact=exact, **limits)
        return merge([part.answer(keys, exclude=exclude, exact=exact, **limits) for part in self.part_searchers(limits)],
                     limits["k"])

    def ready(self) -> None:
        """Bring the index up to the committed entries unless it is (an exact index is built in RAM on first use)."""
        if not self.current():
            self.sync()

    def approximate(self) -> bool:
        """Whether the index (or a part's) is IVF-PQ."""
        metas = [self.parts.meta(name) for name in self.parts.plan(self.ds)] if self.split else [self.index.meta]
        return any(meta.get("kind") == "ivfpq" for meta in metas)

    def limits(self, k: int | None = None, below: int | None = None) -> dict:
        """What a search finds, from the whole memory: `k` neighbours among the ids below `below` and
        `as_of`'s next day, from the recency rule's first id (`above`); `recent`: the dates of the days
        within the maximum age, searched exactly from their keys where the window is narrow for
        IVF-PQ (`_search_recent`), else None (the index)."""
        limits = [b for b in (below, self._below) if b is not None]
        kept = self._recent_days()
        above = self._above(kept)
        narrow = (kept is not None and above and self.approximate()
                  and self.ds.manifest["next_id"] - above < self.index.cfg.exact_below)
        return {"k": k or self.index.cfg.k, "below": min(limits) if limits else None, "above": above,
                "recent": [d.date for d in kept] if narrow and kept is not None else None}

    def answer(self, keys: np.ndarray, k: int, below: int | None, above: int, exclude: np.ndarray | None,
               exact: bool, recent: list[str] | None) -> tuple[np.ndarray, np.ndarray]:
        """The index's work of a search within its `limits`: the index searched (or the `recent` days'
        keys), its head re-ranked exactly (`_exact_head`)."""
        if recent is not None:
            dist, ids = self._search_recent([d for d in self.ds.days if d.date in recent], keys, k, below, exclude)
        else:
            dist, ids = self.index.search(keys, k, below=below, exclude=exclude, above=above)
        pq = self.index.meta.get("kind") == "ivfpq"
        if exact or not pq:  # IVF-PQ's approximate distances: with `exact`, every candidate re-ranked
            self._exact_head(np.asarray(keys, np.float32), dist, ids, ids.shape[1] if pq else 16)
        return dist, ids

    def _exact_head(self, keys: np.ndarray, dist: np.ndarray, ids: np.ndarray, m: int, rows: int = 1024) -> None:
        """FAISS's exact search computes |q|^2 + |x|^2 - 2 q.x, which loses a near neighbour's small
        distance to cancellation, differently for each batch size (a text scored beside others got
        another λ): the m nearest (16: the calibrator reads the top 10) are recomputed from the stored
        keys as |q - x|^2 and re-sorted, ties by id, in place, so that a query's nearest neighbours
        do not depend on what it is searched with."""
        m = min(m, ids.shape[1])
        for lo in range(0, len(keys), rows):
            head = ids[lo : lo + rows, :m]
            d = np.where(head >= 0, ((self.ds.shards.keys_of(head.clip(min=0)) - keys[lo : lo + rows, None]) ** 2).sum(-1), np.inf)
            order = np.lexsort((head, d), axis=1)
            dist[lo : lo + rows, :m], ids[lo : lo + rows, :m] = np.take_along_axis(d, order, 1), np.take_along_axis(head, order, 1)

    def values_of(self, ids: np.ndarray) -> np.ndarray:
        """The value (next token) of each entry id; -1 for -1."""
        return values_of(torch.from_numpy(self.ds.shards.values_by_id()), torch.from_numpy(np.asarray(ids))).numpy()

    def ages(self, ids: np.ndarray) -> np.ndarray:
        """Days between each entry's day and the memory's last day (0 for -1)."""
        day, _ = self.ds.shards.locate(ids)
        ordinals = np.array([dt.date.fromisoformat(d.date).toordinal() for d in self.ds.days] + [0], np.int64)
        today = self.today
        return np.where(day >= 0, (today.toordinal() if today is not None else 0) - ordinals[day], 0)

    def prior(self, ids: np.ndarray) -> np.ndarray | None:
        """Each neighbour's log prior weight, added to -d/T: log(weight) of merged entries (Greedy
        Merging) plus the recency rule's; None where neither applies."""
        weights = self.ds.shards.weights_by_id()
        parts = [np.log(np.where(ids >= 0, weights[ids.clip(min=0)], 1)).astype(np.float32) if weights is not None else None,
                 self.recency.log_prior(self.ages(ids)) if self.recency.half_life else None]
        present = [p for p in parts if p is not None]
        return sum(present[1:], present[0]) if present else None
