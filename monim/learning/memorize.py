"""The daily memorization step: a day's training tokens scored by Θ, chosen by a policy, committed."""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from monim.data.day import Day
from monim.learning.calibration import Sample, sample_path
from monim.learning.decision import Decision
from monim.learning.policies import Policy, policy_params
from monim.lm.features import Features
from monim.storage import articles
from monim.storage.entries import Entries
from monim.theta.memory import Memory


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
    index: dict = field(default_factory=dict)  # the index update: added, removed, rebuilt, recall (its probe's)
    searched: int | None = None  # tokens the decision searched the memory for (None: Θ searched nothing)
    settled: int = 0  # tokens the policy left to the LM alone (MoNIM.settled: its search margin and context)
    probed: int = 0  # of those, searched anyway (one in PROBE_EVERY)
    probe_flipped: int = 0  # of those, decided otherwise than the LM alone: the others' measured error rate

    def as_dict(self) -> dict:
        return asdict(self)


def _timed(search: Callable, timer: dict) -> Callable:
    """The memory's search, its seconds added to timer["search"]."""
    def timed(batch):
        started = time.perf_counter()
        try:
            return search(batch)
        finally:
            timer["search"] += time.perf_counter() - started

    return timed


def memorize_day(memory: Memory, day: Day, policy: Policy, features: Features | None = None, seed: int = 0,
                 force: bool = False, progress: Callable[[int, int], None] | None = None,
                 decision_skip: bool = True) -> DayStats:
    """Score a day's training documents with Θ (LM + memory so far), apply the policy, commit,
    and update the index. Re-running a committed day is a no-op unless forced.

    `features`: where the LM's view of the documents comes from (a feature store other policies'
    runs may have filled already); default: the LM runs under the memory's window.
    `progress(tokens_done, tokens_total)` is called after each scored batch.
    `decision_skip`: search the memory only for the tokens whose decision it can change (the same
    entries are stored) and the policy does not leave to the LM alone (its search margin and context:
    an approximation, its error measured on probes, DayStats.probe_flipped); off: every token is searched.
    """
    with memory.writing():  # one writer at a time; the manifest re-read under the lock
        ds, date = memory.ds, day.date.isoformat()
        if ds.committed(date) and not force:
            rec = next(d for d in ds.days if d.date == date)
            return DayStats(date, rec.tokens_seen, rec.entries, rec.memrate, False, ds.version)
        if not ds.committed(date):
            ds.commits.appendable(date)  # before any work: a day before the last, or a forgotten one
        features = features or memory.features()
        docs = day.train
        tokens = features.tokenize(docs)
        sample = Sample.of(docs, [len(t) for t in tokens], memory.calibrator_cfg)
        timer = {"lm_and_search": 0.0, "policy": 0.0, "search": 0.0}
        rng = np.random.default_rng([seed, day.date.toordinal()])
        parts: list[Entries] = []
        started = time.perf_counter()
        memory.sync()
        decision = policy.decision(memory, docs, tokens, functools.partial(memory.search, k=memory.settings.index.k_decide),
                                   decision_skip) if memory.retrieves else Decision()
        search = _timed(decision.search, timer) if decision.search else None
        searched = 0
        total = sum(max(0, len(t) - 1) for t in tokens)
        # a policy that stores no entry (In-Context RALM) keeps only the articles: no LM pass
        batches = features.scores(docs, f"{date}-train", search, tokens, at_once=memory.at_once) if policy.stores else ()
        tokens_seen = 0 if policy.stores else total
        for batch in batches:
            t = time.perf_counter()
            timer["lm_and_search"] += t - started
            keep = policy.select(batch, memory.theta_scores(batch), memory.lm, rng)
            parts.append(Entries(batch.key[keep], batch.target[keep], list(batch.doc_id[keep]), batch.position[keep]))
            if batch.knn_values is not None:
                searched += len(batch) if batch.knn_skipped is None else int((~batch.knn_skipped).sum())
                decision.count(batch, keep)
            sample.add(batch)
            tokens_seen += len(batch)
            if progress:
                progress(tokens_seen, total)
            started = time.perf_counter()
            timer["policy"] += started - t
        t = time.perf_counter()
        entries, weights, merged = policy.finish(memory, Entries.concat(parts, memory.lm.hidden_size), rng)
        if weights is not None:
            timer["merge"] = time.perf_counter() - t
        t = time.perf_counter()
        sample.save(sample_path(memory, date))  # before the commit: a committed day always has its sample
        ds.commits.commit_day(date, entries, tokens_seen, policy.name, policy_params(policy), force=force,
                      text=articles.day_text(docs, tokens) | articles.seen(day.ids or [d.id for d in docs]),
                      titles={d.id: d.title for d in docs}, weights=weights, merged=merged, searched=searched)
        memory.lexical()  # extend the lexical counts with the day
        timer["commit"] = time.perf_counter() - t
        index = memory.sync()
        timer["index"] = index.pop("seconds")
        memrate = len(entries) / tokens_seen if tokens_seen else 0.0
        return DayStats(date, tokens_seen, len(entries), memrate, True, ds.version, timer, index,
                        searched if search is not None else None, decision.settled, decision.probed,
                        decision.probe_flipped)
