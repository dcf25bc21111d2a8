"""The semiparametric memory Θ reads: datastore + index + calibrator, opened one way by every reader."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import functools
import json
import os
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import faiss
import numpy as np
import torch

from monim.atomic import checksum
from monim.calibrator import LAM_CEIL, Calibrator, examples
from monim.datastore import Datastore
from monim.manifest import DayRecord, recorded
from monim.dedup import Signatures, TwinIndex
from monim.features import Features
from monim.index import MemoryIndex
from monim.knnlm import (Interpolation, ThetaScores, choose_rule, copies, interpolate, knn_full_logprobs, knn_log_weights,
                         prior_lam, row_lam, theta_scores)
from monim.lexical import LexicalCounts
from monim.lm import LM, cached_lm
from monim.lock import Locked, hold
from monim.recency import Recency
from monim.scoring import Found, TokenScores, score
from monim.sources import Document
from monim.settings import READ, THROUGHPUT, Settings, refuse_other


class Memory:
    """A memory directory: its datastore, FAISS index, lexical counts and calibrator, and Θ's scoring.

    Θ (the semiparametric model) interpolates the LM with the kNN distribution using the calibrator's
    per-token λ (`settings.calibrated`) or the constant λ, both trained daily by
    `monim.calibration.calibrate` (or the LM alone, on a day whose Θ did worse than the LM on held-out
    tokens: `fallback`). With `as_of` (a date), the memory is read as it stood after that day (time
    travel, read-only): the days up to it, the calibration made that day and an index search limited
    to their entries.

    `Memory(root, lm, settings)` opens (or starts) a memory to learn into: its first commit records the
    settings (monim.settings), and a memory learned with other settings is refused, naming them.
    Readers open it as it describes itself: `Memory.open(root, as_of=..., **overrides)`.
    """

    def __init__(self, root: Path | str, lm: LM, settings: Settings | None = None,
                 as_of: dt.date | str | None = None, may_differ: set[str] = THROUGHPUT):
        self.lm = lm
        self.ds = Datastore.for_lm(root, lm)
        settings = settings or Settings()
        refuse_other(self.ds.manifest, lm.name, settings, may_differ, self.ds.root)
        self.ds.manifest.setdefault("settings", settings.as_dict())  # recorded by the next commit
        self.ds.manifest["settings"].setdefault("policy", settings.as_dict()["policy"])  # one recorded before them
        self.settings = settings
        self.index = MemoryIndex(root, lm.hidden_size, settings.index)
        self._lock = threading.Lock()  # fills the caches below once when many threads read at once
        self._loaded: dict[str, Calibrator | None] = {}
        self._lexical: LexicalCounts | None = None
        self._twins: tuple[list[str], TwinIndex] | None = None
        self.as_of = None if as_of is None else str(as_of)

    @classmethod
    def open(cls, root: Path | str, lm: LM | None = None, as_of: dt.date | str | None = None, **overrides) -> Memory:
        """Θ as the memory at `root` describes itself: its LM (the model and dtype it was learned with,
        loaded once per process unless given), window, index, calibrator and recency, as of a day.
        `overrides` change how it is read (monim.settings.READ: k, nprobe, calibrated, skip_threshold,
        half_life, max_age, ...); one that would change what was learned is refused, naming the field."""
        ds = Datastore.read(root)
        settings = Settings.from_dict(recorded(ds.manifest)).read_with(**overrides)
        lm = lm or cached_lm(ds.manifest["model"], settings.dtype)
        return cls(root, lm, settings, as_of, may_differ=READ)

    @property
    def calibrator_cfg(self):
        return self.settings.calibrator

    @property
    def recency(self) -> Recency:
        return self.settings.recency

    def features(self, store: Path | str | None = None, max_bytes: int | None = None) -> Features:
        """How Θ sees documents: the LM's features under the memory's window (from a feature store, if given)."""
        return Features(self.lm, self.settings.window, None if store is None else Path(store), max_bytes)

    def at(self, as_of: dt.date | str) -> Memory:
        """This memory as it stood after day `as_of`: a read-only view sharing its datastore and index."""
        view = copy.copy(self)
        view.as_of, view._lexical, view._twins = str(as_of), None, None
        view.__dict__.pop("_below", None)
        return view

    def recent(self, recency: Recency) -> Memory:
        """This memory read with a recency rule (monim.recency): a view sharing its datastore and index."""
        view = copy.copy(self)
        view.settings = replace(self.settings, recency=recency)
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
        return self.ds.theta_at(self.as_of)

    @property
    def interpolation(self) -> Interpolation:
        """The constant (λ, T) last tuned on validation data (defaults before any tuning)."""
        theta = self.theta()
        return Interpolation(theta["lam"], theta["temperature"]) if theta else Interpolation()

    def theta_dir(self) -> Path | None:
        """The folder of the last calibration (its examples and calibrators), if any."""
        rel = self.theta().get("dir")
        return self.ds.root / rel if rel else None

    def calibrator(self) -> Calibrator | None:
        """The last trained calibrator, if any."""
        folder = self.theta_dir()
        if folder is None:
            return None
        with self._lock:
            if str(folder) not in self._loaded:
                path, want = folder / "calibrator.pt", self.theta().get("checksums", {}).get("calibrator.pt")
                if want is not None and (not path.exists() or checksum(path) != want):
                    raise ValueError(f"{path} is {'damaged' if path.exists() else 'missing'}: Θ as of "
                                     f"{self.theta()['date']} cannot be read (`monim fsck --repair` says what it can do)")
                self._loaded[str(folder)] = Calibrator.load(path, self.lm.hidden_size) if path.exists() else None
            return self._loaded[str(folder)]

    @property
    def rule(self) -> str:
        """How Θ weighs the memory per token (monim.calibration.RULES): the rule the last calibration's
        held-out tokens chose (monim.calibration.choose_rule); before any, the calibrator if there is one."""
        nll = self.theta().get("nll")
        if not nll:
            return "calibrator" if self.settings.calibrated and self.calibrator() is not None else "constant"
        return choose_rule(nll, self.settings.calibrated)

    @property
    def fallback(self) -> bool:
        """Whether Θ is the LM alone: every rule did worse than the LM on new held-out text."""
        return self.rule == "lm"

    @property
    def retrieves(self) -> bool:
        """Whether Θ searches this memory (it holds entries and Θ has not fallen back to the LM)."""
        return len(self) > 0 and not self.fallback

    def calibration_files(self) -> list[str]:
        """The files of the calibration tokens gathered so far (one per day), relative to the root."""
        folder = self.theta_dir()
        return json.loads((folder / "meta.json").read_text())["examples"] if folder else []

    def lexical(self) -> LexicalCounts:
        """Token counts and distinct successors over the memorized training text."""
        shards = [d.shard for d in self.days]
        with self._lock:
            if self._lexical is None or self._lexical.shards != shards:
                self._lexical = LexicalCounts.of(self.ds, shards)
            return self._lexical

    def has_twin(self, docs: list[Document]) -> np.ndarray:
        """bool per document: whether an article this memory learned (up to `as_of`) is its near-duplicate."""
        shards = [d.shard for d in self.days]
        with self._lock:
            if self._twins is None or self._twins[0] != shards:
                learned = [Signatures(np.asarray(self.ds.shard(s, "twin_hashes")), np.asarray(self.ds.shard(s, "twin_sizes")))
                           for s in shards if self.ds.has_array(s, "twin_hashes")]
                self._twins = (shards, TwinIndex(Signatures.concat(learned)))
            twins = self._twins[1]
        return twins.has_twin(Signatures.of([d.text for d in docs]))

    def lam(self, batch: TokenScores) -> np.ndarray | float:
        """Θ's λ for each token of a searched batch, by the rule: the calibrator's, the prior's (λ_copy
        where the nearest entry is a copy of the token's context), or the constant one."""
        rule, lam = self.rule, self.interpolation.lam
        if batch.knn_values is None:
            return lam
        if rule == "calibrator" and (calibrator := self.calibrator()) is not None:
            return calibrator.lam(examples(batch, self.lexical()))
        if rule == "prior":
            copied = copies(batch.knn_dist[:, 0], batch.key, self.settings.calibrator.copy_tolerance)
            return prior_lam(copied, lam, self.theta().get("lam_copy", lam))
        return lam

    @property
    def lam_max(self) -> float:
        """The largest λ `lam` gives any token by the rule: the constant λ, the prior's larger of λ and
        λ_copy, the calibrator's ceiling (LAM_CEIL, 0.99: bounds Θ so loosely that no decision is
        certain, monim.policies.MoNIM.certain), 0 for the LM alone."""
        rule, lam = self.rule, self.interpolation.lam
        if rule == "lm":
            return 0.0
        if rule == "calibrator" and self.calibrator() is not None:
            return LAM_CEIL
        if rule == "prior":
            return max(lam, self.theta().get("lam_copy", lam))
        return lam

    def theta_scores(self, batch: TokenScores) -> ThetaScores:
        """log P(target), max log P and top-1 of each token under Θ."""
        return theta_scores(batch, self.interpolation, self.lam(batch), device=self.lm.device)

    def theta_logprobs(self, batch: TokenScores, lm_logp: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Θ's log P over the vocabulary [n, V] for the tokens of a searched batch, from the LM's
        (`lm_logp` [n, V]); with each token's λ [n] and its neighbours' kNN weights [n, k]."""
        values = torch.from_numpy(batch.knn_values).long()
        prior = None if batch.knn_prior is None else torch.from_numpy(batch.knn_prior)
        logw = knn_log_weights(torch.from_numpy(batch.knn_dist), values, self.interpolation.temperature, prior)
        lam = row_lam(batch.knn_values, self.lam(batch))
        logp = interpolate(lm_logp, knn_full_logprobs(logw, values, lm_logp.shape[-1]), lam)
        return logp, lam.numpy(), logw.exp().numpy()

    @contextmanager
    def writing(self, wait: bool = True, say: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold this memory's write lock (re-entrant; `monim.lock.hold`), the manifest re-read under it."""
        self.writable()
        with hold(self.ds.lock, wait, say):
            if self.ds.reload():
                self._lexical, self._twins = None, None
                self._loaded.clear()
            yield

    def sync(self, retrain: bool = False) -> dict:
        """Bring the index up to the committed entries (detects a stale or missing index). It is
        saved unless another process is writing this memory (a reader never waits). A current
        index takes no lock: readers score with it many times a day."""
        if self.index.current(self.ds) and not retrain:
            return self.index.sync(self.ds)
        if not os.access(self.ds.root, os.W_OK):  # a read-only mount: search an index synced here, save nothing
            return self.index.sync(self.ds, retrain, save=False)
        try:
            with hold(self.ds.lock, wait=False):
                return self.index.sync(self.ds, retrain)
        except Locked:
            return self.index.sync(self.ds, retrain, save=False)

    @property
    def today(self) -> dt.date | None:
        """The memory's last day (as of `as_of`): where the ages of its entries are counted from."""
        days = self.days
        return dt.date.fromisoformat(days[-1].date) if days else None

    def _recent_days(self) -> list | None:
        """The days (with entries) within the recency rule's maximum age; None: every day."""
        oldest = self.recency.oldest(self.today) if self.days else None
        return None if oldest is None else [d for d in self.days if d.date >= oldest.isoformat() and d.entries]

    def _above(self) -> int:
        """The first entry id the recency rule lets Θ search (0: all)."""
        kept = self._recent_days()
        if kept is None:
            return 0
        return int(self.ds.shard(kept[0].shard, "ids")[0]) if kept else self.ds.manifest["next_id"]

    def _search_recent(self, keys: np.ndarray, k: int, below: int | None, exclude: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Exact search over the entries within the maximum age, from their stored keys: an IVF-PQ
        index probes its nprobe lists, where a narrow window may hold few of them or none."""
        kept = self._recent_days()
        ids = np.concatenate([self.ds.shard(d.shard, "ids") for d in kept] or [np.zeros(0, np.int64)])
        keep = np.ones(len(ids), bool) if below is None else ids < below
        if exclude is not None:
            keep &= ~np.isin(ids, exclude)
        dist, found = np.full((len(keys), k), np.inf, np.float32), np.full((len(keys), k), -1, np.int64)
        if keep.any():
            xb = np.concatenate([self.ds.shard(d.shard, "keys") for d in kept])[keep].astype(np.float32)
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
        if not self.index.current(self.ds):  # an exact index is built in RAM on first use
            self.sync()
        limits = [b for b in (below, self._below) if b is not None]
        below = min(limits) if limits else None
        above = self._above()
        if above and self.index.meta.get("kind") == "ivfpq" and self.ds.manifest["next_id"] - above < self.index.cfg.exact_below:
            dist, ids = self._search_recent(keys, k or self.index.cfg.k, below, exclude)
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
            d = np.where(head >= 0, ((self.ds.keys_of(head.clip(min=0)) - keys[lo : lo + rows, None]) ** 2).sum(-1), np.inf)
            order = np.lexsort((head, d), axis=1)
            dist[lo : lo + rows, :m], ids[lo : lo + rows, :m] = np.take_along_axis(d, order, 1), np.take_along_axis(head, order, 1)

    def values_of(self, ids: np.ndarray) -> np.ndarray:
        """The value (next token) of each entry id; -1 for -1."""
        return np.where(ids >= 0, self.ds.values_by_id()[ids.clip(min=0)], -1).astype(np.int32)

    def neighbors(self, keys: np.ndarray, k: int | None = None, below: int | None = None,
                  exclude: np.ndarray | None = None, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances and values (-1: none) of each key's k nearest entries (see `nearest`)."""
        dist, ids = self.nearest(keys, k, below, exclude, exact)
        return dist, self.values_of(ids)

    def ages(self, ids: np.ndarray) -> np.ndarray:
        """Days between each entry's day and the memory's last day (0 for -1)."""
        day, _ = self.ds.locate(ids)
        ordinals = np.array([dt.date.fromisoformat(d.date).toordinal() for d in self.ds.days] + [0], np.int64)
        today = self.today.toordinal() if self.days else 0
        return np.where(day >= 0, today - ordinals[day], 0)

    def search(self, batch: TokenScores, skip: bool = True, k: int | None = None,
               wanted: np.ndarray | None = None) -> Found:
        """The LM's hook (monim.scoring.Neighbors): each token's neighbours. With a skip threshold θ
        (calibrator_cfg.skip_threshold), a first search for the `gate_k` nearest entries gives the
        calibrator its neighbour features; tokens whose λ is below θ keep no neighbours (the LM
        alone), unless their nearest entry is a near-exact match (`copy_tolerance`: a repeated
        article); the others are searched in full. `wanted` (bool per token; None: all): the only
        tokens searched at all, the others keep no neighbours (skipped)."""
        cfg, k = self.calibrator_cfg, k or self.index.cfg.k
        wanted = np.ones(len(batch), bool) if wanted is None else np.array(wanted, bool)
        keys = batch.key.astype(np.float32)
        calibrator = self.calibrator() if skip and self.settings.calibrated and cfg.skip_threshold is not None else None
        if calibrator is not None and wanted.any():
            first = dataclasses.replace(batch, knn_dist=None, knn_values=None) if wanted.all() else batch.select(wanted)
            first.knn_dist, first.knn_values = self.neighbors(keys[wanted], cfg.gate_k, exact=True)
            wanted[wanted] = ((calibrator.lam(examples(first, self.lexical())) >= cfg.skip_threshold)
                              | (first.knn_dist[:, 0] <= cfg.copy_tolerance * (keys[wanted]**2).sum(axis=1)))
        dist, ids = np.full((len(batch), k), np.inf, np.float32), np.full((len(batch), k), -1, np.int64)
        if wanted.any():
            dist[wanted], ids[wanted] = self.nearest(keys[wanted], k)
        return Found(dist, self.values_of(ids), ids, self.prior(ids), ~wanted)

    def prior(self, ids: np.ndarray) -> np.ndarray | None:
        """Each neighbour's log prior weight, added to -d/T: log(weight) of merged entries (Greedy
        Merging) plus the recency rule's; None where neither applies."""
        weights = self.ds.weights_by_id()
        parts = [np.log(np.where(ids >= 0, weights[ids.clip(min=0)], 1)).astype(np.float32) if weights is not None else None,
                 self.recency.log_prior(self.ages(ids)) if self.recency.half_life else None]
        parts = [p for p in parts if p is not None]
        return sum(parts[1:], parts[0]) if parts else None

    def score(self, docs: list[Document], skip: bool = True, retrieve: bool | None = None) -> list[TokenScores]:
        """Score documents with the LM (the memory's window) and, where Θ searches the memory (or
        `retrieve`), their neighbours, searched while the LM scores."""
        self.sync()
        retrieve = self.retrieves if retrieve is None else retrieve and len(self) > 0
        return list(score(self.lm, docs, self.settings.window, functools.partial(self.search, skip=skip) if retrieve else None))

    def writable(self) -> None:
        """Refuse to change a memory read as of a past day."""
        if self.as_of is not None:
            raise ValueError(f"{self.ds.root} read as of {self.as_of} is read-only")

    def forget(self, doc_ids: list[str] | None = None, days: list[dt.date | str] | None = None,
               reason: str | None = None) -> int:
        """Remove documents' or days' entries from the datastore (for good: monim.forgotten), then from the index."""
        with self.writing():
            removed = self.ds.forget(doc_ids, days, reason)
            self.sync()
        return removed

    def relearn(self, date: str) -> None:
        """Let a day be learned again, asked by name (Datastore.relearn); the index follows."""
        with self.writing():
            self.ds.relearn(date)
            self.sync()

    def pin(self) -> Memory:
        """Read now everything Θ reads to answer (shards mapped, index, calibrator, counts), so that a
        long-lived reader (a server) keeps answering from this state after a forget rewrites the memory."""
        self.ds.pin()
        self.sync()
        self.calibrator()
        self.ds.values_by_id(), self.ds.weights_by_id()
        if self.rule == "calibrator":
            self.lexical()
        return self

    def checksum(self) -> str:
        """The state of what Θ reads as of `as_of` (Datastore.checksum): one identity for every cache and the registry."""
        return self.ds.checksum(self.as_of)

    def bytes_on_disk(self) -> int:
        return self.ds.bytes_on_disk() + self.index.bytes_on_disk()
