"""The semiparametric memory (datastore + index) and the daily memorization step."""

from __future__ import annotations

import copy
import datetime as dt
import functools
import hashlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from monim.calibrator import Calibrator, CalibratorConfig, Examples, examples, train_calibrator, warm_epochs
from monim.datastore import Datastore, DayRecord, Entries, _write_json
from monim.index import IndexConfig, MemoryIndex
from monim.knnlm import Interpolation, ThetaScores, knn_logprobs_by_temperature, theta_scores, tune_grid
from monim.lexical import LexicalCounts, day_counts
from monim.lm import LM, ScoreConfig, TokenScores, score
from monim.policies import Policy, policy_params
from monim.stream import Day, Document


class Memory:
    """A memory directory: its datastore, FAISS index, lexical counts and calibrator, and Θ's scoring.

    Θ (the semiparametric model) interpolates the LM with the kNN distribution using the calibrator's
    per-token λ (`use_calibrator`) or the constant λ, both trained on validation data by `calibrate`.
    With `as_of` (a date), the memory is read as it stood after that day (time travel, read-only):
    the days up to it, the calibration made that day and an index search limited to their entries.
    """

    def __init__(self, root: Path | str, lm: LM, index_cfg: IndexConfig | None = None,
                 calibrator_cfg: CalibratorConfig | None = None, use_calibrator: bool = True,
                 as_of: dt.date | str | None = None):
        self.lm = lm
        self.ds = Datastore.for_lm(root, lm)
        self.index = MemoryIndex(root, lm.hidden_size, index_cfg)
        self.calibrator_cfg = calibrator_cfg or CalibratorConfig()
        self.use_calibrator = use_calibrator
        self.search_seconds = 0.0
        self.searched = self.skipped = 0
        self._loaded: dict[tuple[str, str], Calibrator | None] = {}
        self._lexical: LexicalCounts | None = None
        self.as_of = None if as_of is None else str(as_of)

    def at(self, as_of: dt.date | str) -> Memory:
        """This memory as it stood after day `as_of`: a read-only view sharing its datastore and index."""
        view = copy.copy(self)
        view.as_of, view._lexical, view.searched, view.skipped = str(as_of), None, 0, 0
        view.__dict__.pop("_below", None)
        return view

    def __len__(self) -> int:
        return len(self.ds) if self.as_of is None else sum(d.entries for d in self.days)

    @property
    def days(self) -> list[DayRecord]:
        """The committed days this memory holds (up to `as_of`)."""
        return [d for d in self.ds.days if self.as_of is None or d.date <= self.as_of]

    @functools.cached_property
    def _below(self) -> int | None:
        """With `as_of` before the last day: the first entry id learned after it (ids grow by day)."""
        days = self.days
        if len(days) == len(self.ds.days):
            return None
        ids = [int(self.ds.shard(d.shard, "ids")[-1]) for d in days if d.entries]
        return max(ids) + 1 if ids else 0

    def theta(self) -> dict:
        """Θ's settings (λ, T, date, dir): the last calibration, or the last one up to `as_of`."""
        if self.as_of is None:
            return self.ds.manifest["theta"]
        folders = [p for p in (self.ds.root / "theta").glob("*/meta.json") if p.parent.name[:10] <= self.as_of]
        if not folders:
            return {}
        # the latest day; a day calibrated twice (forced, or after a crash) counts its last calibration
        meta = max(folders, key=lambda p: (p.parent.name[:10], p.stat().st_mtime_ns))
        record = json.loads(meta.read_text())
        return {k: record[k] for k in ("lam", "temperature", "date")} | {"dir": f"theta/{meta.parent.name}"}

    @property
    def interpolation(self) -> Interpolation:
        """The constant (λ, T) last tuned on validation data (defaults before any tuning)."""
        theta = self.theta()
        return Interpolation(theta["lam"], theta["temperature"]) if theta else Interpolation()

    def theta_dir(self) -> Path | None:
        """The folder of the last calibration (its examples and calibrators), if any."""
        rel = self.theta().get("dir")
        return self.ds.root / rel if rel else None

    def calibrator(self, name: str = "calibrator") -> Calibrator | None:
        """The last trained calibrator ('calibrator') or skip gate ('gate'), if any."""
        folder = self.theta_dir()
        if folder is None:
            return None
        if (str(folder), name) not in self._loaded:
            path = folder / f"{name}.pt"
            self._loaded[(str(folder), name)] = Calibrator.load(path, self.lm.hidden_size) if path.exists() else None
        return self._loaded[(str(folder), name)]

    def calibration_files(self) -> list[str]:
        """The files of the calibration tokens gathered so far (one per day), relative to the root."""
        folder = self.theta_dir()
        return json.loads((folder / "meta.json").read_text())["examples"] if folder else []

    def calibration_set(self) -> Examples | None:
        """The calibration tokens gathered so far."""
        parts = [Examples.load(self.ds.root / p) for p in self.calibration_files()]
        return Examples.concat(parts) if parts else None

    def lexical(self) -> LexicalCounts:
        """Token counts and distinct successors over the memorized training text."""
        shards = [d.shard for d in self.days]
        if self._lexical is None or self._lexical.shards != shards:
            self._lexical = LexicalCounts.of(self.ds, shards)
        return self._lexical

    def lam(self, batch: TokenScores) -> np.ndarray | float:
        """Θ's λ for each token of a scored batch: the calibrator's, or the constant one."""
        calibrator = self.calibrator() if self.use_calibrator else None
        if calibrator is None or batch.knn_values is None:
            return self.interpolation.lam
        return calibrator.lam(examples(batch, self.lexical()))

    def theta_scores(self, batch: TokenScores) -> ThetaScores:
        """log P(target), max log P and top-1 of each token under Θ."""
        return theta_scores(batch, self.interpolation, len(self.lm.tokenizer), self.lam(batch))

    def sync(self, retrain: bool = False) -> dict:
        """Bring the index up to the committed entries (detects a stale or missing index)."""
        return self.index.sync(self.ds, retrain)

    def neighbors(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances and values of each key's k nearest entries (value -1: none)."""
        started = time.perf_counter()
        dist, ids = self.index.search(keys, below=self._below)
        values = np.where(ids >= 0, self.ds.values_by_id()[ids.clip(min=0)], -1).astype(np.int32)
        self.search_seconds += time.perf_counter() - started
        return dist, values

    def search(self, batch: TokenScores, skip: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The LM's hook (monim.lm.Neighbors): search each token's neighbours, except where the
        skip gate predicts λ < θ (calibrator_cfg.skip_threshold); skipped rows get none."""
        theta = self.calibrator_cfg.skip_threshold
        wanted = np.ones(len(batch), bool)
        if skip and self.use_calibrator and theta is not None and (gate := self.calibrator("gate")) is not None:
            wanted = gate.lam(examples(batch, self.lexical())) >= theta
        k = self.index.cfg.k
        dist, values = np.full((len(batch), k), np.inf, np.float32), np.full((len(batch), k), -1, np.int32)
        if wanted.any():
            dist[wanted], values[wanted] = self.neighbors(batch.key[wanted].astype(np.float32))
        self.searched += int(wanted.sum())
        self.skipped += int((~wanted).sum())
        return dist, values

    def score(self, docs: list[Document], cfg: ScoreConfig | None = None, skip: bool = True) -> list[TokenScores]:
        """Score documents with the LM and, if the memory holds entries, their neighbours."""
        self.sync()
        return list(score(self.lm, docs, cfg, functools.partial(self.search, skip=skip) if len(self) else None))

    def writable(self) -> None:
        """Refuse to change a memory read as of a past day."""
        if self.as_of is not None:
            raise ValueError(f"{self.ds.root} read as of {self.as_of} is read-only")

    def forget(self, doc_ids: list[str] | None = None, days: list[dt.date | str] | None = None) -> int:
        """Remove documents' or days' entries from the datastore, and then from the index."""
        self.writable()
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
    memory.writable()
    ds, date = memory.ds, day.date.isoformat()
    if ds.committed(date) and not force:
        rec = next(d for d in ds.days if d.date == date)
        return DayStats(date, rec.tokens_seen, rec.entries, rec.memrate, False, ds.version)
    docs = day.train[:max_docs]
    tokens = [memory.lm.tokenizer(d.text)["input_ids"] for d in docs]
    total = sum(max(0, len(t) - 1) for t in tokens)
    timer = {"lm_and_search": 0.0, "policy": 0.0}
    memory.search_seconds = 0.0
    rng = np.random.default_rng([seed, day.date.toordinal()])
    parts: list[Entries] = []
    tokens_seen = 0
    started = time.perf_counter()
    memory.sync()
    search = memory.search if len(memory) and policy.uses_theta else None
    for batch in score(memory.lm, docs, cfg, search):
        t = time.perf_counter()
        timer["lm_and_search"] += t - started
        keep = policy.select(batch, memory.theta_scores(batch), memory.lm, rng)
        parts.append(Entries(batch.key[keep], batch.target[keep], list(batch.doc_id[keep]), batch.position[keep]))
        tokens_seen += len(batch)
        if progress:
            progress(tokens_seen, total)
        started = time.perf_counter()
        timer["policy"] += started - t
    entries = Entries.concat(parts, memory.lm.hidden_size)
    t = time.perf_counter()
    ds.commit_day(date, entries, tokens_seen, policy.name, policy_params(policy), force=force, text=day_counts(tokens))
    memory.lexical()  # extend the lexical counts with the day
    timer["commit"] = time.perf_counter() - t
    timer["index"] = memory.sync()["seconds"]
    timer["search"] = memory.search_seconds
    memrate = len(entries) / tokens_seen if tokens_seen else 0.0
    return DayStats(date, tokens_seen, len(entries), memrate, True, ds.version, timer)


def calibrate(memory: Memory, date: str, docs: list[Document], cfg: ScoreConfig | None = None,
              force: bool = False) -> dict:
    """Add a day's validation articles to the calibration set, tune the constant (λ, T) on the whole
    set and train the calibrator and the skip gate on it; the next day's Θ and evaluation use them.

    Each day's calibration tokens keep the features they had when the day was calibrated (never
    rescored), so the set grows by a few articles a day at a constant cost. Re-running a calibrated
    day changes nothing unless forced.
    """
    memory.writable()
    theta = memory.ds.manifest["theta"]
    same_day = theta.get("date") == date
    if not len(memory) or (same_day and not force):
        return theta | {"trained": False}
    ccfg = memory.calibrator_cfg
    docs = docs[: ccfg.docs_per_day]
    chain = memory.calibration_files()
    chain = chain[:-1] if same_day else chain  # a forced re-run replaces the day's own examples
    lexical, parts = memory.lexical(), []
    for batch in memory.score(docs, cfg, skip=False):
        held = np.array([_held_out(d, ccfg.holdout) for d in batch.doc_id], dtype=bool)
        parts.append(examples(batch, lexical, knn_logprobs_by_temperature(batch), held))
    new = Examples.concat(parts) if parts else None
    calibration = Examples.concat([Examples.load(memory.ds.root / p) for p in chain] + ([new] if new else []))
    interp, _ = tune_grid(calibration.lm_logp.astype(np.float64), calibration.knn_logp.astype(np.float64))
    trained = {}
    for name, gcfg in (("calibrator", ccfg), ("gate", ccfg.without("density"))):
        if not gcfg.groups:
            continue
        start = memory.calibrator(name) if ccfg.warm_start and not same_day else None
        epochs = warm_epochs(gcfg, len(chain)) if start is not None else gcfg.max_epochs
        trained[name] = train_calibrator(calibration, gcfg, interp.lam, interp.temperature, start, epochs)
    name = f"{date}-{uuid.uuid4().hex[:8]}"
    folder = memory.ds.root / "theta" / name
    tmp = folder.with_name(f".tmp-{name}")
    tmp.mkdir(parents=True)
    if new is not None:
        new.save(tmp / "examples.npz")
        chain = [*chain, f"theta/{name}/examples.npz"]
    for key, calibrator in trained.items():
        calibrator.record["date"] = date
        calibrator.save(tmp / f"{key}.pt")
    record = {"date": date, "lam": interp.lam, "temperature": interp.temperature, "calibration_tokens": len(calibration),
              "new_tokens": len(new) if new else 0} | {k: c.record for k, c in trained.items()}
    _write_json(tmp / "meta.json", record | {"examples": chain})
    os.replace(tmp, folder)
    memory.ds.set_theta({"lam": interp.lam, "temperature": interp.temperature, "date": date, "dir": f"theta/{name}"})
    return record | {"trained": True}


def _held_out(doc_id: str, every: int) -> bool:
    """Whether a calibration article is held back for early stopping (fixed by its id)."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % every == 0
