"""A generation's sentences, each with its sources: the memorized articles whose entries carried its kNN weight."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from monim.data.feed import short_title
from monim.lm.model import LM

if TYPE_CHECKING:  # its type only: the Decoder runs without FAISS (benchmarks/gpu.py)
    from monim.theta.memory import Memory

SENTENCE_END = (".", "!", "?")  # and a blank line


@dataclass
class Cited:
    """A memorized article and the kNN weight its entries gave the tokens of a sentence."""

    date: str
    doc_id: str
    title: str
    weight: float


def entry_articles(memory: Memory, ids: list[int]) -> dict[int, tuple[str, str, str]]:
    """(day, document id, title) of memory entry ids."""
    ds = memory.ds
    day, row = ds.shards.locate(np.array(ids, np.int64))
    out = {}
    for i in np.unique(day[day >= 0]):
        rec = ds.days[i]
        docs, names = np.asarray(ds.shards.shard(rec.shard, "docs")), ds.shards.shard_docs(rec.shard)
        titles = ds.shards.shard_titles(rec.shard) or [""] * len(names)
        for j in np.flatnonzero(day == i):
            d = int(docs[row[j]])
            out[ids[j]] = (rec.date, names[d], short_title(titles[d]))  # (stored before titles were capped)
    return out


def sentences(lm: LM, memory: Memory | None, tokens: list[int], credit: list[dict], top: int) -> list[dict]:
    """The generated text cut into sentences, each with the `top` memorized articles that carried
    the most kNN weight over its tokens."""
    spans, start = [], 0
    pieces = [lm.decode([t]) for t in tokens]
    for i, piece in enumerate(pieces):
        after = pieces[i + 1][:1] if i + 1 < len(pieces) else " "
        # a mark ends a sentence only before a space: "2.277" does not (an abbreviation like "U.S. x" still does)
        ends = piece.rstrip().endswith(SENTENCE_END) and (piece[-1:].isspace() or after.isspace())
        if ends or "\n\n" in piece or i == len(tokens) - 1:
            spans.append((start, i + 1))
            start = i + 1
    everything = sorted({e for c in credit for e in c})
    docs = entry_articles(memory, everything) if memory is not None and everything else {}
    out = []
    for a, b in spans:
        per_doc: dict[tuple[str, str, str], float] = defaultdict(float)
        for c in credit[a:b]:
            for entry, w in c.items():
                if entry in docs:
                    per_doc[docs[entry]] += w
        best = sorted(per_doc.items(), key=lambda kv: -kv[1])[:top]
        out.append({"text": lm.decode(tokens[a:b], skip_special_tokens=True),
                    "sources": [asdict(Cited(*doc, weight=w)) for doc, w in best]})
    return out
