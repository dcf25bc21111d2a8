"""The articles a memory learned, kept in each day's shard, and BM25 over them (In-Context RALM's retriever).

Each day's shard holds its training articles (id, title, text) as one UTF-8 JSON array, so the
datastore's commit, lock, forget and `as_of` govern them as they govern entries. The BM25 index is
derived from the articles a memory holds as of its day (rebuilt, never stored: a day's IDF counts
only the articles learned by then) by bm25s, Lucene's BM25 (k1 = 1.2, b = 0.75) over lower-cased
words of 2+ letters without English stop words.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import numpy as np

from monim.dedup import Signatures, TwinIndex
from monim.sources import Document

logging.getLogger("bm25s").setLevel(logging.WARNING)  # it says each build and each query without terms at INFO
ARRAY = "articles"  # the shard array that holds them
SEEN = "seen"  # the shard array of the ids of every article the day read (a memory knows them: an id names one article)
K1, B = 1.2, 0.75  # Lucene's defaults
CANDIDATES = 8  # top articles fetched per query, so that excluded ones still leave a best


@dataclass(frozen=True)
class Article:
    """One learned article, as retrieval returns it."""

    id: str
    title: str
    text: str
    date: str


def pack(docs: Sequence[Document]) -> dict[str, np.ndarray]:
    """A day's training articles as the shard array that keeps them."""
    return _array([[d.id, d.title, d.text] for d in docs])


def seen(ids: Sequence[str]) -> dict[str, np.ndarray]:
    """The ids of every article a day read, as the shard array that keeps them."""
    return _array(list(ids), SEEN)


def _array(rows: list, name: str = ARRAY) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(json.dumps(rows, ensure_ascii=False).encode(), np.uint8).copy()}


def unpack(array: np.ndarray) -> list[list[str]]:
    """[[id, title, text], ...] (or the ids seen) from a shard's array."""
    return json.loads(bytes(np.asarray(array)).decode())


def without(arrays: dict[str, np.ndarray], doc_ids: set[str]) -> dict[str, np.ndarray]:
    """A shard's text arrays with these documents' articles removed (forget)."""
    if ARRAY not in arrays or not doc_ids:
        return arrays
    return arrays | _array([a for a in unpack(arrays[ARRAY]) if a[0] not in doc_ids])


class Shards(Protocol):
    """Where articles are kept (monim.datastore.Datastore)."""

    def shard_articles(self, name: str) -> list[list[str]]: ...


def words(texts: list[str]) -> list[list[str]]:
    """BM25's terms of each text."""
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class ArticleIndex:
    """BM25 over a memory's articles as of its day; `best` excludes an article and its near-duplicates."""

    def __init__(self, articles: list[Article]):
        import bm25s

        self.articles = articles
        self.position = {a.id: i for i, a in enumerate(articles)}
        self.bm25 = bm25s.BM25(k1=K1, b=B, method="lucene")
        if articles:
            self.bm25.index(words([f"{a.title}\n{a.text}" for a in articles]), show_progress=False)
        self._twins: TwinIndex | None = None

    @classmethod
    def of(cls, ds: Shards, shards: Iterable[tuple[str, str]]) -> ArticleIndex:
        """The index over the articles of these (date, shard) pairs (cached while the shards stand)."""
        return _index(ds, tuple(shards))

    def __len__(self) -> int:
        return len(self.articles)

    def twins_of(self, doc: Document) -> set[str]:
        """The held articles that are `doc` or its near-duplicates, where `doc` is itself held (training
        text scored: the calibrator's rule); none for text the memory never learned."""
        if doc.id not in self.position:
            return set()
        if self._twins is None:
            self._twins = TwinIndex(Signatures.of(a.text for a in self.articles))
        return {doc.id} | {self.articles[i].id for i in self._twins.twins(Signatures.of([doc.text]), 0)}

    def best(self, queries: list[str], exclude: list[set[str]] | None = None) -> list[Article | None]:
        """The best-scoring article for each query (None: no article shares a term with it), passing over
        the ids in its `exclude` set."""
        if not self.articles or not queries:
            return [None] * len(queries)
        k = min(CANDIDATES, len(self.articles))
        ids, scores = self.bm25.retrieve(words(queries), k=k, show_progress=False, n_threads=1)
        out = []
        for i, (row, score) in enumerate(zip(ids, scores)):
            skip = exclude[i] if exclude else set()
            found = [int(j) for j, s in zip(row, score) if s > 0 and self.articles[int(j)].id not in skip]
            if not found and skip and k < len(self.articles):  # every candidate excluded: rank them all
                found = self._all(queries[i], skip)
            out.append(self.articles[found[0]] if found else None)
        return out

    def _all(self, query: str, skip: set[str]) -> list[int]:
        ids, scores = self.bm25.retrieve(words([query]), k=len(self.articles), show_progress=False, n_threads=1)
        return [int(j) for j, s in zip(ids[0], scores[0]) if s > 0 and self.articles[int(j)].id not in skip]


@functools.lru_cache(maxsize=8)
def _index(ds: Shards, shards: tuple[tuple[str, str], ...]) -> ArticleIndex:
    return ArticleIndex([Article(i, t, x, date) for date, shard in shards for i, t, x in ds.shard_articles(shard)])
