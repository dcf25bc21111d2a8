"""The articles a memory learned, kept in each day's shard: each day's shard holds its training
articles (id, title, text) as one UTF-8 JSON array, so the datastore's commit, lock, forget and
`as_of` govern them as they govern entries (BM25 over them: monim.theta.retriever)."""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from monim.data.sources import Document

ARRAY = "articles"  # the shard array that holds them
SEEN = "seen"  # the shard array of the ids of every article the day read (a memory knows them: an id names one article)


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
