"""BM25 over the articles a memory learned (In-Context RALM's retriever): derived from the articles
a memory holds as of its day (rebuilt, never stored: a day's IDF counts only the articles learned by
then) by bm25s, Lucene's BM25 (k1 = 1.2, b = 0.75) over lower-cased words of 2+ letters without
English stop words."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from monim.data.dedup import Signatures, TwinIndex
from monim.data.feed import Document

if TYPE_CHECKING:
    from monim.storage.datastore import Datastore

K1, B = 1.2, 0.75  # Lucene's defaults
CANDIDATES = 8  # top articles fetched per query, so that excluded ones still leave a best


@dataclass(frozen=True)
class Article:
    """One learned article, as retrieval returns it."""

    id: str
    title: str
    text: str
    date: str


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
    def of(cls, ds: Datastore, shards: Iterable[tuple[str, str]]) -> ArticleIndex:
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
        terms = words(queries) if self.articles and queries else []
        asked = [i for i, t in enumerate(terms) if t]  # a query without terms matches nothing (bm25s logs it)
        out: list[Article | None] = [None] * len(queries)
        if not asked:
            return out
        k = min(CANDIDATES, len(self.articles))
        ids, scores = self.bm25.retrieve([terms[i] for i in asked], k=k, show_progress=False, n_threads=1)
        for i, row, score in zip(asked, ids, scores):
            skip = exclude[i] if exclude else set()
            found = [int(j) for j, s in zip(row, score) if s > 0 and self.articles[int(j)].id not in skip]
            if not found and skip and k < len(self.articles):  # every candidate excluded: rank them all
                found = self._all(terms[i], skip)
            out[i] = self.articles[found[0]] if found else None
        return out

    def _all(self, terms: list[str], skip: set[str]) -> list[int]:
        ids, scores = self.bm25.retrieve([terms], k=len(self.articles), show_progress=False, n_threads=1)
        return [int(j) for j, s in zip(ids[0], scores[0]) if s > 0 and self.articles[int(j)].id not in skip]


@functools.lru_cache(maxsize=8)
def _index(ds: Datastore, shards: tuple[tuple[str, str], ...]) -> ArticleIndex:
    return ArticleIndex([Article(i, t, x, date) for date, shard in shards for i, t, x in ds.shards.shard_articles(shard)])
