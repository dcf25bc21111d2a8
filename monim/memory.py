"""The semiparametric memory (datastore + index) and the daily memorization step."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from monim.datastore import Datastore, Entries
from monim.index import IndexConfig, MemoryIndex
from monim.knnlm import Interpolation, theta_scores, tune_interpolation
from monim.lm import LM, ScoreConfig, TokenScores, count_targets, score
from monim.policies import Policy, policy_params
from monim.stream import Day, Document


class Memory:
    """A memory directory: its datastore, its FAISS index, and kNN search for the LM."""

    def __init__(self, root: Path | str, lm: LM, index_cfg: IndexConfig | None = None):
        self.lm = lm
        self.ds = Datastore.for_lm(root, lm)
        self.index = MemoryIndex(root, lm.hidden_size, index_cfg)
        self.search_seconds = 0.0

    def __len__(self) -> int:
        return len(self.ds)

    @property
    def interpolation(self) -> Interpolation:
        """The constant (λ, T) last tuned on validation data (defaults before any tuning)."""
        return Interpolation(**self.ds.manifest["theta"]) if self.ds.manifest["theta"] else Interpolation()

    def sync(self, retrain: bool = False) -> dict:
        """Bring the index up to the committed entries (detects a stale or missing index)."""
        return self.index.sync(self.ds, retrain)

    def neighbors(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances and values of each key's k nearest entries (value -1: none)."""
        started = time.perf_counter()
        dist, ids = self.index.search(keys)
        values = np.where(ids >= 0, self.ds.values_by_id()[ids.clip(min=0)], -1).astype(np.int32)
        self.search_seconds += time.perf_counter() - started
        return dist, values

    def score(self, docs: list[Document], cfg: ScoreConfig | None = None) -> list[TokenScores]:
        """Score documents with the LM and, if the memory holds entries, their neighbours."""
        self.sync()
        return list(score(self.lm, docs, cfg, self.neighbors if len(self) else None))

    def forget(self, doc_ids: list[str] | None = None, days: list[dt.date | str] | None = None) -> int:
        """Remove documents' or days' entries from the datastore, and then from the index."""
        removed = self.ds.forget(doc_ids, days)
        self.sync()
        return removed

    def bytes_on_disk(self) -> int:
        return self.ds.bytes_on_disk() + self.index.bytes_on_disk()


@dataclass
class DayStats:
    """What memorizing one day did."""

    date: str
    tokens_seen: int
    stored: int
    memrate: float
    committed: bool  # False: the day was already in memory and nothing changed
    version: int  # the memory's version after the day
    seconds: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def memorize_day(memory: Memory, day: Day, policy: Policy, cfg: ScoreConfig | None = None,
                 max_docs: int | None = None, seed: int = 0, force: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> DayStats:
    """Score a day's training documents with Θ (LM + memory so far), apply the policy, commit,
    and update the index. Re-running a committed day is a no-op unless forced.

    `progress(tokens_done, tokens_total)` is called after each scored batch.
    """
    ds, date = memory.ds, day.date.isoformat()
    if ds.committed(date) and not force:
        rec = next(d for d in ds.days if d.date == date)
        return DayStats(date, rec.tokens_seen, rec.entries, rec.memrate, False, ds.version)
    docs = day.train[:max_docs]
    total = count_targets(memory.lm, docs) if progress else 0
    interp = memory.interpolation
    timer = {"lm_and_search": 0.0, "policy": 0.0}
    memory.search_seconds = 0.0
    rng = np.random.default_rng([seed, day.date.toordinal()])
    parts: list[Entries] = []
    tokens_seen = 0
    started = time.perf_counter()
    memory.sync()
    search = memory.neighbors if len(memory) and policy.uses_theta else None
    for batch in score(memory.lm, docs, cfg, search):
        t = time.perf_counter()
        timer["lm_and_search"] += t - started
        keep = policy.select(batch, theta_scores(batch, interp, len(memory.lm.tokenizer)), memory.lm, rng)
        parts.append(Entries(batch.key[keep], batch.target[keep], list(batch.doc_id[keep]), batch.position[keep]))
        tokens_seen += len(batch)
        if progress:
            progress(tokens_seen, total)
        started = time.perf_counter()
        timer["policy"] += started - t
    entries = Entries.concat(parts, memory.lm.hidden_size)
    t = time.perf_counter()
    ds.commit_day(date, entries, tokens_seen, policy.name, policy_params(policy), force=force)
    timer["commit"] = time.perf_counter() - t
    timer["index"] = memory.sync()["seconds"]
    timer["search"] = memory.search_seconds
    memrate = len(entries) / tokens_seen if tokens_seen else 0.0
    return DayStats(date, tokens_seen, len(entries), memrate, True, ds.version, timer)


def calibrate(memory: Memory, docs: list[Document], cfg: ScoreConfig | None = None) -> Interpolation:
    """Tune the constant (λ, T) on validation documents; the next day's Θ and evaluation use it."""
    if not docs or not len(memory):
        return memory.interpolation
    interp, _ = tune_interpolation(memory.score(docs, cfg))
    memory.ds.set_theta(asdict(interp))
    return interp
