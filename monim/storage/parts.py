"""A memory's index split by day range into parts once it outgrows one worker (IndexConfig.part_bytes).

Layout under the memory directory:
    parts/plan.json          the first day of each part, in order (written by the writer, under the lock)
    parts/<first day>/index/ that part's index (monim.storage.index.MemoryIndex over its days alone)
A part holds the days from its first day to the next part's (the first part also any earlier day).
A new part starts at the first day that would take the last one past `part_bytes` of index; parts
already planned never move, so a new day, a forget or a relearn changes only the parts of the days it
changes (a part's version is a hash of its days). A search asks every part and merges their top-k.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from monim.core.atomic import write_json
from monim.core.config import IndexConfig
from monim.core.manifest import CommittedDay
from monim.storage.datastore import Datastore
from monim.storage.index import MemoryIndex, pq_subquantizers

PLAN = "plan.json"


def entry_bytes(kind: str, d: int, cfg: IndexConfig) -> int:
    """Bytes of index an entry takes: its fp32 key in an exact index, its code in IVF-PQ; its id in both."""
    if kind == "flat":
        return 4 * d + 8
    return (d // cfg.fastscan_dims // 2 if cfg.codec == "fastscan" else pq_subquantizers(d, cfg.code_bytes)) + 8


def version(days: list[CommittedDay]) -> str:
    """A part's version: a hash of its days' shards (it changes when one of them does, and only then)."""
    held = [(d.date, d.shard, d.entries, d.checksums) for d in days]
    return hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:16]


def merge(found: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of several parts' answers for the same queries, by distance then id (id -1: none):
    the merged exact top-k of exact parts is the exact top-k."""
    if len(found) == 1:
        return found[0]
    dist, ids = np.concatenate([d for d, _ in found], axis=1), np.concatenate([i for _, i in found], axis=1)
    order = np.lexsort((np.where(ids >= 0, ids, np.iinfo(np.int64).max), dist), axis=1)[:, :k]
    return np.take_along_axis(dist, order, 1), np.take_along_axis(ids, order, 1)


class Parts:
    """The parts of a memory's index (their plan, their indexes), past `part_bytes` of index."""

    def __init__(self, root: Path | str, hidden_size: int, cfg: IndexConfig):
        self.dir = Path(root) / "parts"
        self.d, self.cfg = hidden_size, cfg
        self._recorded: tuple[int, list[str]] | None = None  # (the memory's version it was read at, the plan's first days)
        self._indexes: dict[str, MemoryIndex] = {}

    def recorded(self, ds: Datastore) -> list[str]:
        """The first days of the parts the writer planned (re-read once the memory changed)."""
        if self._recorded is None or self._recorded[0] != ds.version:
            path = self.dir / PLAN
            self._recorded = (ds.version, json.loads(path.read_text())["starts"] if path.exists() else [])
        return self._recorded[1]

    def plan(self, ds: Datastore) -> list[str]:
        """The parts' first days: those planned, then a new part from each later day that would take
        the last part past `part_bytes` of index (bytes of the index the whole memory calls for)."""
        starts, days = list(self.recorded(ds)), [d for d in ds.days if d.entries]
        if self.cfg.part_bytes is None or not days:
            return starts
        starts = starts or [days[0].date]
        per, held = entry_bytes(self.index(starts[0]).kind_for(ds), self.d, self.cfg), 0
        for day in (d for d in days if d.date >= starts[-1]):
            if held and held + day.entries * per > self.cfg.part_bytes:
                starts.append(day.date)
                held = 0
            held += day.entries * per
        return starts

    def split(self, ds: Datastore) -> bool:
        """Whether the memory is searched in parts (more than one planned)."""
        return len(self.plan(ds)) > 1

    def days(self, ds: Datastore) -> dict[str, list[CommittedDay]]:
        """Each part's days, by its name (its first day)."""
        starts = self.plan(ds)
        held: dict[str, list[CommittedDay]] = {s: [] for s in starts}
        for day in ds.days:
            held[starts[max(0, int(np.searchsorted(starts, day.date, side="right")) - 1)]].append(day)
        return held

    def versions(self, ds: Datastore) -> dict[str, str]:
        """Each part's version, by its name."""
        return {name: version(days) for name, days in self.days(ds).items()}

    def view(self, ds: Datastore, name: str) -> Datastore:
        """Part `name`'s days as a datastore of their own (read-only), at the part's version."""
        days = self.days(ds)[name]
        return ds.view([d.date for d in days], version(days))

    def index(self, name: str) -> MemoryIndex:
        """Part `name`'s index (read from its folder once)."""
        if name not in self._indexes:
            self._indexes[name] = MemoryIndex(self.dir / name, self.d, self.cfg)
        return self._indexes[name]

    def current(self, ds: Datastore) -> bool:
        """Whether every part's index holds its days' version."""
        return all(self.index(name).current(self.view(ds, name)) for name in self.plan(ds))

    def sync_part(self, ds: Datastore, name: str, retrain: bool = False, save: bool = True) -> dict:
        """Bring part `name`'s index up to its days (MemoryIndex.sync): exact or IVF-PQ by its own entries."""
        view, index = self.view(ds, name), self.index(name)
        return index.sync(view, retrain, save, kind=index.kind_for(ds, len(view)))

    def sync(self, ds: Datastore, retrain: bool = False, save: bool = True) -> dict:
        """Bring every part's index up to its days, the plan saved with them (under the memory's lock):
        a part whose days did not change is not touched."""
        started = time.perf_counter()
        starts = self.plan(ds)
        stats = [self.sync_part(ds, name, retrain, save) for name in starts]
        if save:
            if starts != self.recorded(ds):
                write_json(self.dir / PLAN, {"starts": starts})
                self._recorded = (ds.version, starts)
        return {"added": sum(s["added"] for s in stats), "removed": sum(s["removed"] for s in stats),
                "rebuilt": any(s["rebuilt"] for s in stats), "parts": len(starts),
                "seconds": time.perf_counter() - started}

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file()) if self.dir.exists() else 0
