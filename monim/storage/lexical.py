"""Lexical statistics of the text a memory has learned from: token counts, distinct successors and
the contexts it holds (hashes of each token's last SEEN_CONTEXT tokens).

Each committed day keeps its own counts in its shard (`day_counts`); `LexicalCounts.of` sums them
over the committed days, kept in `lexical.npz` beside the manifest and extended day by day (a
derived file, like the index: rebuilt from the shards when it does not match them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import numpy as np

from monim.core.atomic import replacing
from monim.core.config import SEEN_CONTEXT

if TYPE_CHECKING:  # torch only where the features are computed: the storage layer loads without it
    import torch

TEXT_ARRAYS = ("lex_tokens", "lex_counts", "lex_pairs")
GRAMS = "lex_grams"  # a day's distinct contexts; absent from days committed before contexts were kept
CACHE = "lexical.npz"  # the counts over every committed day, beside the manifest
_MULT = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit multiplier: the contexts' polynomial hash


def context_grams(doc: Sequence[int] | np.ndarray) -> np.ndarray:
    """uint64 per token of a document: a hash of the SEEN_CONTEXT tokens before it (the document's
    start padded), so a token's context is in a memory's text iff its hash is in LexicalCounts.grams."""
    ids = np.concatenate([np.zeros(SEEN_CONTEXT, np.uint64), np.asarray(doc, np.int64).astype(np.uint64) + np.uint64(1)])
    h = np.zeros(len(ids) - SEEN_CONTEXT, np.uint64)
    for j in range(SEEN_CONTEXT):  # wrapping uint64 arithmetic is the hash's modulus
        h = h * _MULT + ids[j: j + len(h)]
    return h


def day_counts(documents: Iterable[Sequence[int]]) -> dict[str, np.ndarray]:
    """One day's token ids with their counts, its distinct (token, next token) pairs as codes, and its
    distinct contexts (`context_grams`)."""
    docs = [np.asarray(d, dtype=np.int64) for d in documents]
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    ids, counts = np.unique(tokens, return_counts=True)
    pairs = np.unique(np.concatenate([(d[:-1] << 32) | d[1:] for d in docs])) if docs else np.zeros(0, np.int64)
    grams = np.unique(np.concatenate([context_grams(d) for d in docs])) if docs else np.zeros(0, np.uint64)
    return {"lex_tokens": ids, "lex_counts": counts.astype(np.int64), "lex_pairs": pairs, GRAMS: grams}


class Days(Protocol):
    """What the counts read of a datastore's shards (monim.storage.shards.Shards, which keep each day's
    counts: not imported here)."""

    root: Path

    @property
    def days(self) -> list: ...

    def has_array(self, name: str, array: str) -> bool: ...

    def shard(self, name: str, array: str, mmap: bool = True) -> np.ndarray: ...


def lexical_features(count: torch.Tensor, distinct: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """[n, 2]: log(count + 1) and log(#distinct successors + 1) of each last context token, from the
    tables by token id (LexicalCounts'; tensors on one device)."""
    import torch

    if not len(count):  # nothing memorized yet
        return torch.zeros((len(prev), 2), device=prev.device)
    known = prev < len(count)
    at = torch.where(known, prev, 0)
    return torch.stack([torch.where(known, t[at], 0) for t in (count, distinct)], dim=1).double().log1p().float()


@dataclass
class LexicalCounts:
    """Occurrences of each token, its distinct successors and the contexts, over all memorized training text."""

    count: np.ndarray  # int64, indexed by token id
    pairs: np.ndarray  # sorted distinct codes (token << 32) | next token
    shards: list[str]  # the committed days' shards these counts cover
    grams: np.ndarray | None  # sorted distinct context hashes (context_grams); None: a day's are not known

    @functools.cached_property
    def distinct(self) -> np.ndarray:
        """How many distinct tokens follow each token id."""
        return np.bincount(self.pairs >> 32, minlength=len(self.count)).astype(np.int64)

    def features(self, prev: np.ndarray) -> np.ndarray:
        """[n, 2]: log(count + 1) and log(#distinct successors + 1) of each last context token (`lexical_features`)."""
        import torch

        tokens = torch.from_numpy(np.asarray(prev, dtype=np.int64))
        return lexical_features(torch.from_numpy(self.count), torch.from_numpy(self.distinct), tokens).numpy()

    def seen(self, grams: np.ndarray) -> np.ndarray:
        """bool per context hash: whether the memorized text holds that context (all True where unknown)."""
        if self.grams is None:
            return np.ones(len(grams), bool)
        at = np.minimum(np.searchsorted(self.grams, grams), max(len(self.grams) - 1, 0))
        return self.grams[at] == grams if len(self.grams) else np.zeros(len(grams), bool)

    def add(self, day: dict[str, np.ndarray], shard: str) -> LexicalCounts:
        """These counts plus one day's."""
        size = max(len(self.count), int(day["lex_tokens"].max()) + 1 if len(day["lex_tokens"]) else 0)
        count = np.zeros(size, np.int64)
        count[: len(self.count)] = self.count
        np.add.at(count, day["lex_tokens"], day["lex_counts"])
        grams = None if self.grams is None or GRAMS not in day else np.union1d(self.grams, day[GRAMS])
        return LexicalCounts(count, np.union1d(self.pairs, day["lex_pairs"]), [*self.shards, shard], grams)

    @classmethod
    def empty(cls) -> LexicalCounts:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), [], np.zeros(0, np.uint64))

    @classmethod
    def of(cls, ds: Days, shards: list[str] | None = None) -> LexicalCounts:
        """The counts over every committed day (or these first days' shards): from the cache if
        current, extended, or rebuilt; the cache keeps the counts of all committed days."""
        every = [d.shard for d in ds.days]
        shards = every if shards is None else shards
        path = ds.root / CACHE
        counts = cls.empty()
        if path.exists():
            with np.load(path) as f:
                cached = cls(f["count"], f["pairs"], list(f["shards"]), f["grams"] if f["grams_known"] else None) \
                    if "grams_known" in f else None  # a cache from before contexts were kept: rebuilt
            if cached is not None and cached.shards == shards[: len(cached.shards)]:
                counts = cached
        if counts.shards == shards:
            return counts
        for shard in shards[len(counts.shards):]:
            if ds.has_array(shard, "lex_pairs"):
                kept = [a for a in (*TEXT_ARRAYS, GRAMS) if ds.has_array(shard, a)]
                counts = counts.add({a: np.asarray(ds.shard(shard, a)) for a in kept}, shard)
            else:  # a day committed without its text (or whose text was forgotten)
                counts = cls(counts.count, counts.pairs, [*counts.shards, shard], counts.grams)
        if shards != every:
            return counts
        with replacing(path) as tmp:
            grams = counts.grams
            np.savez(tmp, count=counts.count, pairs=counts.pairs, shards=np.array(counts.shards, dtype=str),
                     grams=grams if grams is not None else np.zeros(0, np.uint64), grams_known=grams is not None)
        return counts
