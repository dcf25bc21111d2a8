"""The articles a memory learned, kept in each day's shard: each day's shard holds its training
articles (id, title, text) as one UTF-8 JSON array, so the datastore's commit, lock, forget and
`as_of` govern them as they govern entries (BM25 over them: monim.theta.retriever)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Sequence

import numpy as np

from monim.data.dedup import Signatures
from monim.data.feed import Document
from monim.storage.lexical import day_counts

ARRAY = "articles"  # the shard array that holds them
SEEN = "seen"  # the shard array of the ids of every article the day read (a memory knows them: an id names one article)


def day_text(docs: Sequence[Document], tokens: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """What a day's shard keeps of its training text (`tokens`: the documents' token ids): its lexical
    counts, its articles' near-duplicate signatures and the articles themselves."""
    return day_counts(tokens) | Signatures.of([d.text for d in docs]).arrays() | pack(docs)


def pack(docs: Sequence[Document]) -> dict[str, np.ndarray]:
    """A day's training articles as the shard array that keeps them."""
    return _array([[d.id, d.title, d.text] for d in docs])


def seen(ids: Sequence[str]) -> dict[str, np.ndarray]:
    """The ids of every article a day read, as the shard array that keeps them."""
    return _array(list(ids), SEEN)


def _array(rows: list, name: str = ARRAY) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(json.dumps(rows, ensure_ascii=False).encode(), np.uint8).copy()}


def unpack(array: np.ndarray) -> list[Any]:
    """[[id, title, text], ...] (or the ids seen) from a shard's array."""
    return json.loads(bytes(np.asarray(array)).decode())


def documents(array: np.ndarray, date: str) -> list[Document]:
    """The articles a shard keeps (its ARRAY), as the day's Documents."""
    return [Document(id=i, date=dt.date.fromisoformat(date), text=text, title=title) for i, title, text in unpack(array)]
