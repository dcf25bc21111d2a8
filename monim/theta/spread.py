"""A memory's searches spread over workers: each search's queries split into chunks, each chunk
searched in every part of the memory (monim.storage.parts; the whole index where it is not split) by
`search_part` on a worker that opens the memory read-only, the parts' top-k merged and the chunks
gathered in order. The limits of a search (time travel, recency) are computed here, by the memory's
own Searcher; the index work runs on the workers, with the same code as in one process.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from monim.core.config import IndexConfig
from monim.core.recency import Recency
from monim.core.workers import Workers
from monim.storage.datastore import Datastore
from monim.storage.index import MemoryIndex
from monim.storage.parts import Parts, merge
from monim.theta.searcher import Searcher


class StaleSearch(RuntimeError):
    """A worker was asked to search a version of the memory that is no longer on disk."""


@dataclass(frozen=True)
class SearchPart:
    """One chunk of a search's queries in one part of the memory at `root` (None: its whole index),
    bounded as the memory's Searcher.limits says: what a worker needs to answer it (picklable)."""

    root: str  # absolute: the workers read it on a shared filesystem
    version: int | str  # the memory's version (part None), or the part's (Parts.version)
    part: str | None
    keys: np.ndarray  # float32 [n, d]
    k: int
    below: int | None
    above: int
    exclude: np.ndarray | None
    exact: bool  # IVF-PQ's candidates re-ranked with the stored keys (an exact index's head always is)
    recent: list[str] | None  # the days searched exactly from their keys (Searcher.limits); None: the index
    index: IndexConfig  # how the index is read (a reader's nprobe)


_opened: dict[tuple[str, str | None], tuple[tuple, Searcher]] = {}  # (root, part) -> (version, settings), its Searcher


def opened(root: str, version: int | str, part: str | None, cfg: IndexConfig) -> Searcher:
    """The memory at `root` (one part of it) opened read-only as of `version`, once per process:
    its shards mapped, an exact index built in RAM from their keys, an IVF-PQ one read as the writer
    saved it. Nothing is written and no lock taken."""
    key, state = (root, part), (version, dataclasses.astuple(cfg))
    if key in _opened and _opened[key][0] == state:
        return _opened[key][1]
    _opened.pop(key, None)  # an older version's index goes before the new one is read
    ds = Datastore.read(root)
    if part is None:
        view, index = ds, MemoryIndex(root, ds.manifest["hidden_size"], cfg)
        ready = lambda: index.sync(ds, save=False)  # noqa: E731
    else:
        parts = Parts(root, ds.manifest["hidden_size"], cfg)
        view, index = parts.view(ds, part), parts.index(part)
        ready = lambda: parts.sync_part(ds, part, save=False)  # noqa: E731
    if view.version != version:
        raise StaleSearch(f"{root}: asked to search version {version!r} of {part or 'the memory'}, but it is at "
                          f"{view.version!r} (changed since the search was asked)")
    ready()
    searcher = Searcher(view, index, None, Recency())
    _opened[key] = (state, searcher)
    return searcher


def search_part(request: SearchPart) -> tuple[np.ndarray, np.ndarray]:
    """A worker's share of a search: squared distances (float32 [n, k]) and ids (int64 [n, k]) of
    the request's keys' nearest entries in its part (Searcher.answer)."""
    r = request
    searcher = opened(r.root, r.version, r.part, r.index)
    return searcher.answer(r.keys, r.k, r.below, r.above, r.exclude, r.exact, r.recent)


def chunks(n: int, workers: int, batch: int) -> list[tuple[int, int]]:
    """The queries' split among `workers`: whole multiples of the index's query batch, so that each
    query is searched with the same neighbours in its batch as in one process (FAISS's exact
    distances depend in their last bits on the batch a query is searched in)."""
    step = -(-max(1, -(-n // workers)) // batch) * batch
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


@dataclass
class Spread:
    """Where a memory's searches run, shared by the memory and every view of it: on `workers`, or
    in this process (None)."""

    workers: Workers | None = None

    def nearest(self, searcher: Searcher, keys: np.ndarray, k: int | None = None, below: int | None = None,
                exclude: np.ndarray | None = None, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Searcher.nearest, its index work on the workers: every chunk of the queries in every part."""
        if self.workers is None or not len(keys):
            return searcher.nearest(keys, k, below, exclude, exact)
        searcher.ready()
        limits = searcher.limits(k, below)
        root = os.path.abspath(searcher.ds.root)
        parts = searcher.parts.versions(searcher.ds) if searcher.split else {None: searcher.ds.version}
        keys = np.asarray(keys, np.float32)
        spans = chunks(len(keys), self.workers.size, searcher.index.cfg.query_batch)
        asks = [SearchPart(root, version, part, keys[lo:hi], exclude=exclude, exact=exact, index=searcher.index.cfg, **limits)
                for lo, hi in spans for part, version in parts.items()]
        found = self.workers.map(search_part, asks)
        per = len(parts)
        merged = [merge(found[i : i + per], limits["k"]) for i in range(0, len(found), per)]
        return np.concatenate([d for d, _ in merged]), np.concatenate([i for _, i in merged])
