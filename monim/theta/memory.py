"""The semiparametric memory Θ reads: datastore + index + calibrator, opened one way by every reader."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import functools
import json
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from monim.core.lock import hold
from monim.core.manifest import CommittedDay, recorded
from monim.core.recency import Recency
from monim.core.workers import Workers
from monim.data.dedup import TWINS, Signatures, TwinIndex
from monim.data.feed import Document
from monim.lm.features import Features
from monim.lm.model import LM, cached_lm
from monim.lm.scoring import score
from monim.lm.token_scores import Found, TokenScores
from monim.storage import articles
from monim.storage.datastore import Datastore
from monim.storage.index import MemoryIndex, backend
from monim.storage.lexical import LexicalCounts
from monim.storage.memory_settings import READ, THROUGHPUT, Settings, refuse_other
from monim.storage.parts import Parts
from monim.storage.verify import Verified, looked_again, verified
from monim.theta.calibrator import Calibrator, examples, skips
from monim.theta.device import DeviceTables, DeviceTheta
from monim.theta.knnlm import Interpolation, ThetaScores
from monim.theta.rule import ThetaRule
from monim.theta.searcher import Searcher
from monim.theta.spread import Spread


class DeviceState:
    """A memory on the LM's device (Memory.on_device), one for a memory and its views: the datastore's
    state it holds, its values by id there, each reading's DeviceTables (as of a day, by a recency
    rule) and each DeviceTheta of them, all let go together when the datastore changes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one copy made at a time (not Memory's `_lock`: lexical() takes it)
        self.let_go(None)

    def follow(self, state: tuple) -> None:
        """Let go of what it holds if the datastore has changed since (to `state`): a commit or forget frees
        the old copies at once, not when the memory is next read on the device."""
        with self.lock:
            if self.state is not None and self.state != state:
                self.let_go(None)

    def let_go(self, state: tuple | None) -> None:
        """Hold nothing, for the datastore's `state` (the keys: MemoryIndex.exact_on's)."""
        self.state: tuple | None = state
        self.values: torch.Tensor | None = None
        self.tables: dict[tuple, DeviceTables] = {}
        self.thetas: dict[tuple, tuple[tuple, DeviceTheta]] = {}  # by reading, skip, rule, neighbours: what made it, it


class Memory:
    """A memory directory read as Θ: its datastore, index and lexical counts, its Searcher and its ThetaRule.

    Θ (the semiparametric model) interpolates the LM with the kNN distribution using the calibrator's
    per-token λ (`settings.calibrated`) or the constant λ, both trained daily by
    `monim.learning.calibration.calibrate` (or the LM alone, on a day whose Θ did worse than the LM on held-out
    tokens: `fallback`). With `as_of` (a date), the memory is read as it stood after that day (time
    travel, read-only): the days up to it, the calibration made that day and an index search limited
    to their entries.

    `Memory(root, lm, settings)` opens (or starts) a memory to learn into: its first commit records the
    settings (monim.storage.memory_settings), and a memory learned with other settings is refused, naming them.
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
        self.parts = Parts(root, lm.hidden_size, settings.index)
        self._spread = Spread()  # shared with every view: spread_over reaches them all
        self._lock = threading.Lock()  # fills the caches below once when many threads read at once
        self._lexical: LexicalCounts | None = None
        self._twins: tuple[list[str], TwinIndex] | None = None
        self._device = DeviceState()  # the memory on the LM's device (on_device), shared with every view
        self._device_choice: tuple[int, bool] | None = None  # searched_on_device, by the memory's size
        self.as_of = None if as_of is None else str(as_of)
        self._verified: Verified = {}  # the shard files Memory.open read against their commit
        self._searcher = Searcher(self.ds, self.index, self.as_of, settings.recency, self.parts)
        self._rule = ThetaRule(self.ds, lm, settings, self.as_of, self.lexical)

    @classmethod
    def open(cls, root: Path | str, lm: LM | None = None, as_of: dt.date | str | None = None,
             removing: tuple[str, ...] = (), **overrides) -> Memory:
        """Θ as the memory at `root` describes itself: its LM (the model and dtype it was learned with,
        loaded once per process unless given), window, index, calibrator and recency, as of a day.
        `overrides` change how it is read (monim.storage.memory_settings.READ: k, nprobe, calibrated, skip_threshold,
        half_life, max_age, ...); one that would change what was learned is refused, naming the field.
        First every shard Θ reads is checked against its commit (but the days a forget is `removing`),
        the LM loaded after."""
        ds = Datastore.read(root)
        files = verified(ds, as_of, removing)
        settings = Settings.from_dict(recorded(ds.manifest)).read_with(**overrides)
        lm = lm or cached_lm(ds.manifest["model"], settings.dtype)
        memory = cls(root, lm, settings, as_of, may_differ=READ)
        memory._verified = files
        return memory

    @property
    def calibrator_cfg(self):
        return self.settings.calibrator

    def features(self, store: Path | str | None = None, max_bytes: int | None = None) -> Features:
        """How Θ sees documents: the LM's features under the memory's window (from a feature store, if given)."""
        return Features(self.lm, self.settings.window, None if store is None else Path(store), max_bytes)

    def at(self, as_of: dt.date | str) -> Memory:
        """This memory as it stood after day `as_of`: a read-only view sharing its datastore, index and loaded calibrators."""
        view = copy.copy(self)
        view.as_of, view._lexical, view._twins = str(as_of), None, None
        view._searcher = Searcher(self.ds, self.index, view.as_of, self.settings.recency, self.parts)
        view._rule = self._rule.at(view.as_of, view.lexical)
        return view

    def recent(self, recency: Recency) -> Memory:
        """This memory read with a recency rule (monim.core.recency): a view sharing its datastore and index."""
        view = copy.copy(self)
        view.settings = dataclasses.replace(self.settings, recency=recency)
        view._searcher = Searcher(self.ds, self.index, self.as_of, recency, self.parts)
        return view

    def __len__(self) -> int:
        return len(self.ds) if self.as_of is None else sum(d.entries for d in self.days)

    @property
    def days(self) -> list[CommittedDay]:
        """The committed days this memory holds (up to `as_of`)."""
        return self.ds.days_at(self.as_of)

    def lexical(self) -> LexicalCounts:
        """Token counts and distinct successors over the memorized training text."""
        shards = [d.shard for d in self.days]
        with self._lock:
            if self._lexical is None or self._lexical.shards != shards:
                self._lexical = LexicalCounts.of(self.ds.shards, shards)
            return self._lexical

    def has_twin(self, docs: list[Document]) -> np.ndarray:
        """bool per document: whether an article this memory learned (up to `as_of`) is its near-duplicate."""
        shards = [d.shard for d in self.days]
        with self._lock:
            if self._twins is None or self._twins[0] != shards:
                learned = [Signatures(*(np.asarray(self.ds.shards.shard(s, a)) for a in TWINS)) for s in shards
                           if self.ds.shards.has_array(s, TWINS[0])]
                self._twins = (shards, TwinIndex(Signatures.concat(learned)))
            twins = self._twins[1]
        return twins.has_twin(Signatures.of([d.text for d in docs]))

    def sync(self, retrain: bool = False) -> dict:
        """Bring the index up to the committed entries (Searcher.sync)."""
        return self._searcher.sync(retrain)

    def spread_over(self, workers: Workers | None) -> None:
        """From now on search this memory (and every view of it: `at`, `recent`) on `workers`, each
        search's queries split among them and gathered in order (monim.theta.spread); None: in this
        process. The answers are the same. While on workers, this process holds no part of a memory
        split in parts (monim.storage.parts): it saves each part it changes and lets it go."""
        self._spread.workers = workers
        self.parts.searched_here(workers is None)

    @property
    def at_once(self) -> int:
        """Searches worth asking together: as many as the workers it is spread over run at once (1 here)."""
        return self._spread.workers.size if self._spread.workers is not None else 1

    def nearest(self, keys: np.ndarray, k: int | None = None, below: int | None = None,
                exclude: np.ndarray | None = None, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances and ids of each key's k nearest entries (Searcher.nearest), searched where `spread_over` says."""
        return self._spread.nearest(self._searcher, keys, k, below, exclude, exact)

    def neighbors(self, keys: np.ndarray, k: int | None = None, below: int | None = None,
                  exclude: np.ndarray | None = None, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances and values (-1: none) of each key's k nearest entries (`nearest`)."""
        dist, ids = self.nearest(keys, k, below, exclude, exact)
        return dist, self._searcher.values_of(ids)

    def search(self, batch: TokenScores, skip: bool = True, k: int | None = None,
               wanted: np.ndarray | None = None) -> Found:
        """The LM's hook (monim.lm.token_scores.Neighbors): each token's neighbours. With a skip threshold θ
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
            wanted[wanted] = ~skips(calibrator.lam(examples(first, self.lexical())), first.knn_dist[:, 0], keys[wanted], cfg)
        dist, ids = np.full((len(batch), k), np.inf, np.float32), np.full((len(batch), k), -1, np.int64)
        if wanted.any():
            dist[wanted], ids[wanted] = self.nearest(keys[wanted], k)
        return Found(dist, self._searcher.values_of(ids), ids, self._searcher.prior(ids), ~wanted)

    def theta(self) -> dict:
        """Θ's settings (λ, T, date, dir): the last calibration, or the last one up to `as_of`."""
        return self._rule.theta()

    @property
    def interpolation(self) -> Interpolation:
        """The constant (λ, T) last tuned on validation data (ThetaRule.interpolation)."""
        return self._rule.interpolation

    def calibrator(self) -> Calibrator | None:
        """The last trained calibrator, if any."""
        return self._rule.calibrator()

    def calibration_files(self) -> list[str]:
        """The files of the calibration tokens gathered so far (ThetaRule.calibration_files)."""
        return self._rule.calibration_files()

    @property
    def rule(self) -> str:
        """How Θ weighs the memory per token (ThetaRule.name)."""
        return self._rule.name

    @property
    def fallback(self) -> bool:
        """Whether Θ is the LM alone (ThetaRule.fallback)."""
        return self._rule.fallback

    @property
    def retrieves(self) -> bool:
        """Whether Θ searches this memory (it holds entries and Θ has not fallen back to the LM)."""
        return len(self) > 0 and not self.fallback

    def lam(self, batch: TokenScores, rule: str | None = None) -> np.ndarray | float:
        """Θ's λ for each token of a searched batch, by its rule or `rule` (ThetaRule.lam)."""
        return self._rule.lam(batch, rule)

    @property
    def lam_max(self) -> float:
        """The largest λ `lam` gives any token (ThetaRule.lam_max)."""
        return self._rule.lam_max

    def theta_scores(self, batch: TokenScores) -> ThetaScores:
        """log P(target), max log P and top-1 of each token under Θ."""
        return self._rule.theta_scores(batch)

    def theta_logprobs(self, batch: TokenScores, lm_logp: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Θ's log P over the vocabulary, each token's λ and its neighbours' kNN weights (ThetaRule.theta_logprobs)."""
        return self._rule.theta_logprobs(batch, lm_logp)

    @contextmanager
    def writing(self, wait: bool = True, say: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold this memory's write lock (re-entrant; `monim.core.lock.hold`), the manifest re-read under it."""
        self.writable()
        with hold(self.ds.lock, wait, say):
            if self.ds.reload():
                self._lexical, self._twins = None, None
                self._rule.reloaded()
            try:
                yield
            finally:
                self._device.follow(self.ds.state)

    def score(self, docs: list[Document], skip: bool = True, retrieve: bool | None = None,
              on_device: bool | None = None) -> list[TokenScores]:
        """Score documents with the LM (the memory's window) and, where Θ searches the memory (or
        `retrieve`), their neighbours, searched while the LM scores: `on_device` (None:
        `searched_on_device`), on the LM's device (DeviceTheta: Θ's scores too), else by `search`."""
        self.sync()
        retrieve = self.retrieves if retrieve is None else retrieve and len(self) > 0
        on_device = self.searched_on_device if on_device is None else on_device
        hook = (self.on_device(skip) if on_device else functools.partial(self.search, skip=skip)) if retrieve else None
        return list(score(self.lm, docs, self.settings.window, hook))

    @property
    def searched_on_device(self) -> bool:
        """Whether Θ reads this memory on the LM's device by default (`on_device`): where its searches run
        in torch (a GPU without FAISS's GPU build) and in this process. Chosen once for a memory's size:
        the keys it copies to the GPU then take from the free memory the choice reads."""
        size = len(self)
        if self._device_choice is None or self._device_choice[0] != size:
            self._device_choice = (size, backend(self.index.cfg, size, self.lm.hidden_size) == "torch")
        return self._spread.workers is None and self._device_choice[1]

    def on_device(self, skip: bool = True, rule: str | None = None, neighbors: bool = True) -> DeviceTheta:
        """This memory as Θ reads it (by its rule, or `rule`) held on the LM's device (DeviceTheta): the
        entries a search may find (as of its day, within the recency rule's age), searched exactly;
        its keys (MemoryIndex.exact_on) and tables (DeviceTables) copied there once per state of the
        datastore, shared by its views and variants. `neighbors` off: the host reads Θ's scores, not the neighbours."""
        reading, held = (self.as_of, self.settings.recency), self._device
        variant, made = (reading, skip, rule, neighbors), (json.dumps(self.theta(), sort_keys=True), self.calibrator_cfg,
                                                           self.settings.calibrated, self.interpolation)
        with held.lock:
            if held.state != self.ds.state:
                held.let_go(self.ds.state)  # the old copies let go before the new ones are made
            if reading not in held.tables:
                self._searcher.ready()
                limits, next_id = self._searcher.limits(), int(self.ds.manifest["next_id"])
                if held.values is None:
                    held.values = torch.from_numpy(self.ds.shards.values_by_id()).to(self.lm.device)
                keys = self.index.exact_on(self.ds, self.lm.device).within(limits["above"], limits["below"])
                held.tables[reading] = DeviceTables(keys, held.values, self._searcher.prior(np.arange(next_id)), self.lexical)
            if variant not in held.thetas or held.thetas[variant][0] != made:  # a calibration replaces the variant
                cfg, by = self.calibrator_cfg, rule or self.rule
                skipping = skip and self.settings.calibrated and cfg.skip_threshold is not None
                calibrator = self.calibrator() if skipping or by == "calibrator" else None
                held.thetas[variant] = made, DeviceTheta(held.tables[reading], self.index.cfg.k, cfg, by, self.interpolation,
                                                         self.theta().get("lam_copy", self.interpolation.lam), calibrator,
                                                         skipping, neighbors)
            return held.thetas[variant][1]

    def writable(self) -> None:
        """Refuse to change a memory read as of a past day."""
        if self.as_of is not None:
            raise ValueError(f"{self.ds.root} read as of {self.as_of} is read-only")

    def forget(self, doc_ids: list[str] | None = None, days: Sequence[dt.date | str] | None = None,
               reason: str | None = None, store: Path | str | None = None) -> int:
        """Remove documents or days from the datastore (for good, and all of them: monim.storage.forgotten and
        Commits.forget) and from the index; with `store` (a feature store), the LM's features of them too."""
        with self.writing():
            removed = self.ds.commits.forget(doc_ids, days, reason, self.day_text, None if store is None else Path(store))
            self.sync()
        return removed

    def day_text(self, docs: list[Document]) -> dict[str, np.ndarray]:
        """What a day's shard keeps of these training articles (monim.storage.articles.day_text), tokenized by the LM."""
        return articles.day_text(docs, self.features().tokenize(docs))

    def relearn(self, date: str) -> None:
        """Let a day be learned again, asked by name (Commits.relearn); the index follows."""
        with self.writing():
            self.ds.commits.relearn(date)
            self.sync()

    def pin(self) -> Memory:
        """Read now everything Θ reads to answer (shards mapped, index, calibrator, counts), so that a
        long-lived reader (a server) keeps answering from this state after a forget rewrites the memory."""
        self.ds.shards.pin()
        self.sync()
        self.calibrator()
        self.ds.shards.values_by_id(), self.ds.shards.weights_by_id()
        if self.rule == "calibrator":
            self.lexical()
        return self

    def damaged(self) -> str | None:
        """Why a shard file verified at open now differs from its commit (None: none does), looked at
        again by a long-lived reader (looked_again)."""
        with self._lock:
            return looked_again(self._verified)

    def checksum(self) -> str:
        """The state of what Θ reads as of `as_of` (Datastore.checksum): one identity for every cache and the registry."""
        return self.ds.checksum(self.as_of)

    def bytes_on_disk(self) -> int:
        return self.ds.bytes_on_disk() + self.index.bytes_on_disk()
