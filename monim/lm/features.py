"""The feature store: what the frozen LM says about each document, computed once and kept on disk.

Every consumer (memorization under any policy, calibration, evaluation, the suite, `monim eval`)
needs the same per-token view of a document: the key, the LM's statistics and the final hidden
state (from which Θ gets the LM's log-probability of any candidate token). `Features` gives it,
running the LM only for documents the store has not seen under the same model and window settings.
Layout: `<store>/<settings tag>/<name>/` holds one `.npy` per field and `docs.json` (per document:
text digest, first row, rows); a folder is written aside and renamed into place (atomic).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from monim.core.atomic import TMP, is_stray, replacing
from monim.core.config import ScoreConfig
from monim.core.run_config import RunConfig
from monim.data.feed import Document
from monim.lm.model import LM
from monim.lm.scoring import score_tokens, with_neighbors
from monim.lm.token_scores import Neighbors, TokenScores
from monim.lm.windows import fit_window

STORED = ("prev", "target", "logp", "max_logp", "entropy", "argmax", "key", "hidden")
Progress = Callable[[int, int], None]  # (tokens done, tokens in all)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class Features:
    """The LM's scores (with hidden states) of documents: read from `store` where it holds them,
    else computed with `cfg` (and kept there, when there is a store)."""

    lm: LM
    cfg: ScoreConfig = field(default_factory=ScoreConfig)
    store: Path | None = None
    max_bytes: int | None = None  # the store's size cap: the oldest folders go first
    computed: int = 0  # tokens the LM scored through this object
    _index: dict[str, tuple[str, int, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cfg: RunConfig, lm: LM) -> Features:
        """How a run gets the LM's view of documents: from its work directory's feature store, or the LM."""
        store = Path(cfg.workdir) / "features" if cfg.feature_store else None
        return cls(lm, cfg.window(), store, int(cfg.feature_cap_gb * 2**30))

    @cached_property
    def folder(self) -> Path:
        """The store's folder for this model and these window settings."""
        if self.store is None:
            raise ValueError("features computed without a store have no folder")
        cfg = fit_window(self.lm, self.cfg)
        settings = {"model": self.lm.name, "vocab": self.lm.fingerprint, "weights": self.lm.weights, "stride": cfg.stride,
                    "context": cfg.context, "context_mode": cfg.context_mode}
        if self.lm.dtype != "float32":  # folders of float32 features keep the names they had before dtypes
            settings["dtype"] = self.lm.dtype
        return Path(self.store) / hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]

    def tokenize(self, docs: list[Document]) -> list[list[int]]:
        return self.lm.tokenizer([d.text for d in docs])["input_ids"] if docs else []

    def prepare(self, docs: list[Document], name: str = "docs", progress: Progress | None = None,
                ids: list[list[int]] | None = None) -> int:
        """Put the documents the store lacks into it (no-op without a store); the tokens scored."""
        if self.store is None:
            return 0
        return self._ensure(docs, [digest(d.text) for d in docs], name, progress, ids)

    def _ensure(self, docs: list[Document], digests: list[str], name: str, progress: Progress | None,
                ids: list[list[int]] | None) -> int:
        self._refresh()
        missing = {h: i for i, h in enumerate(digests) if h not in self._index}
        if not missing:
            return 0
        before = self.computed
        self._write([docs[i] for i in missing.values()], None if ids is None else [ids[i] for i in missing.values()],
                    name, progress)
        return self.computed - before

    def scores(self, docs: list[Document], name: str = "docs", neighbors: Neighbors | None = None,
               ids: list[list[int]] | None = None, chunk: int = 4096, at_once: int = 1) -> Iterator[TokenScores]:
        """Batches covering the documents, with hidden states, and with `neighbors` (a memory's
        search) each token's nearest entries; `ids`: the documents' tokens, if already known.
        From the store: document order, about `chunk` tokens a batch (`name`: the folder for
        documents it lacks), `at_once` of its chunks searched together (with_neighbors)."""
        if self.store is None:
            yield from self._live(docs, self.tokenize(docs) if ids is None else ids, None, neighbors)
            return
        digests = [digest(d.text) for d in docs]
        self._ensure(docs, digests, name, None, ids)
        for batch in self._read(docs, digests, chunk):
            yield with_neighbors(self.lm, batch, neighbors, at_once=at_once) if neighbors is not None else batch

    def _live(self, docs: list[Document], ids: list[list[int]], progress: Progress | None,
              neighbors: Neighbors | None = None) -> Iterator[TokenScores]:
        total, done = sum(max(0, len(t) - 1) for t in ids), 0
        # searching while scoring needs no hidden states: the chunk's logits are at hand
        for batch in score_tokens(self.lm, ((d.id, t, 1) for d, t in zip(docs, ids)), self.cfg, neighbors,
                                  keep_hidden=neighbors is None):
            done += len(batch)
            self.computed += len(batch)
            if progress:
                progress(done, total)
            yield batch

    def _refresh(self) -> None:
        """Index the documents of every complete folder (folders written by other runs too)."""
        folder = self.folder
        if not folder.is_dir():
            return
        known = {v[0] for v in self._index.values()}
        for meta in folder.glob("*/docs.json"):
            if meta.parent.name not in known:
                for h, start, n in json.loads(meta.read_text()):
                    self._index.setdefault(h, (meta.parent.name, start, n))

    def _write(self, docs: list[Document], ids: list[list[int]] | None, name: str, progress: Progress | None) -> None:
        """Score documents and keep their features as one new folder."""
        ids = self.tokenize(docs) if ids is None else ids
        lengths = [max(0, len(t) - 1) for t in ids]
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        total = int(starts[-1])
        row_of = {d.id: int(s) for d, s in zip(docs, starts)}
        name = f"{name}-{uuid.uuid4().hex[:8]}"
        with replacing(self.folder / name) as tmp:
            tmp.mkdir()
            arrays: dict[str, np.memmap] = {}
            for batch in self._live(docs, ids, progress):
                if not arrays:
                    arrays = {f: np.lib.format.open_memmap(tmp / f"{f}.npy", "w+", getattr(batch, f).dtype,
                                                           (total, *getattr(batch, f).shape[1:])) for f in STORED}
                rows = np.array([row_of[d] for d in batch.doc_id], np.int64) + batch.position - 1
                for f in STORED:
                    arrays[f][rows] = getattr(batch, f)
            for a in arrays.values():
                a.flush()
            del arrays
            (tmp / "docs.json").write_text(json.dumps([[digest(d.text), int(s), n] for d, s, n in zip(docs, starts, lengths)]))
        for d, s, n in zip(docs, starts, lengths):
            self._index[digest(d.text)] = (name, int(s), n)
        if self.store is not None and self.max_bytes is not None:
            cap(self.store, self.max_bytes, keep=self.folder / name)

    def _read(self, docs: list[Document], digests: list[str], chunk: int) -> Iterator[TokenScores]:
        opened: dict[str, dict[str, np.ndarray]] = {}
        pending: list[tuple[Document, str, int, int]] = []
        size = 0
        for doc, h in zip(docs, digests):
            name, start, n = self._index[h]
            if n:
                pending.append((doc, name, start, n))
                size += n
            if size >= chunk:
                yield self._batch(pending, opened)
                pending, size = [], 0
        if pending:
            yield self._batch(pending, opened)

    def _batch(self, pending: list[tuple[Document, str, int, int]], opened: dict) -> TokenScores:
        for _, name, _, _ in pending:
            if name not in opened:
                opened[name] = {f: np.load(self.folder / name / f"{f}.npy", mmap_mode="r") for f in STORED}
        fields = {f: np.concatenate([opened[name][f][s : s + n] for _, name, s, n in pending]) for f in STORED}
        return TokenScores(doc_id=np.array([d.id for d, _, _, n in pending for _ in range(n)], dtype=object),
                           position=np.concatenate([np.arange(1, n + 1, dtype=np.int32) for *_, n in pending]),
                           **fields)


def balanced_parts(docs: list[Document], n: int) -> list[list[Document]]:
    """At most `n` non-empty parts of about equal text length (longest first, each to the lightest
    part), for workers that run the LM in parallel."""
    parts: list[list[Document]] = [[] for _ in range(max(1, min(n, len(docs))))]
    sizes = [0] * len(parts)
    for doc in sorted(docs, key=lambda d: len(d.text), reverse=True):
        i = sizes.index(min(sizes))
        parts[i].append(doc)
        sizes[i] += len(doc.text)
    return [p for p in parts if p]


def _folders(store: Path) -> list[Path]:
    return [p for p in Path(store).glob("*/*") if p.is_dir() and not is_stray(p)]


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def cap(store: Path | str, max_bytes: int, keep: Path | None = None) -> list[str]:
    """Delete the least recently written folders until the store fits in `max_bytes`."""
    folders = sorted(_folders(Path(store)), key=lambda p: p.stat().st_mtime_ns)
    total = sum(_size(p) for p in folders)
    removed = []
    for p in folders:
        if total <= max_bytes:
            break
        if p != keep:
            total -= _size(p)
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def forget(store: Path | str, digests: set[str], dates: set[str]) -> list[str]:
    """Delete the folders that hold any of these documents (by text digest) or any document of these
    dates (YYYY-MM-DD): a forget leaves nothing of them in the store (other documents are scored again
    when next asked); the names of the folders deleted."""
    removed = []
    for p in _folders(Path(store)):
        meta = p / "docs.json"
        if p.name[:10] in dates or meta.exists() and digests & {h for h, *_ in json.loads(meta.read_text())}:
            shutil.rmtree(p)
            removed.append(p.name)
    return removed


def _date(name: str) -> dt.date | None:
    try:
        return dt.date.fromisoformat(name[:10])
    except ValueError:
        return None


def gc(store: Path | str, keep_days: int | None = None, max_bytes: int | None = None) -> dict:
    """Clean the store: keep the folders of the newest `keep_days` dates (undated ones stay), then
    the newest folders that fit in `max_bytes`; leftovers of interrupted writes always go."""
    store = Path(store)
    before = sum(_size(p) for p in _folders(store)) if store.is_dir() else 0
    removed = []
    for tmp in store.glob(f"*/{TMP}*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if keep_days is not None:
        dates = sorted({d for p in _folders(store) if (d := _date(p.name))})
        keep = set(dates[-keep_days:]) if keep_days > 0 else set()
        for p in _folders(store):
            if (d := _date(p.name)) and d not in keep:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    if max_bytes is not None:
        removed += cap(store, max_bytes)
    after = sum(_size(p) for p in _folders(store)) if store.is_dir() else 0
    return {"removed": len(removed), "bytes_before": before, "bytes_after": after}
