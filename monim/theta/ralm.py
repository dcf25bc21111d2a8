"""In-Context RALM (Ram et al., TACL 2023) as Θ reads it: every `ralm_stride` tokens, the last
`ralm_query` tokens retrieve the best article the memory learned (monim.storage.articles), which is put before
the text within the memory's window, and the next stride is scored after it. A memory with entries
(ralm+monim-amt) then searches its kNN memory with the hidden states of those passes.

A stride's pass reads the text as the LM alone does (the memory's window: `context + stride` tokens,
the stride's last) after the article's first tokens, up to `context` of them, within the LM's positions:
RALM sees what the LM alone sees and an article more. The LM reads about
(2 context + stride) / ralm_stride tokens per scored token: ~48 at the defaults (512, 512, 32).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from monim.data.feed import Document
from monim.lm.model import LM
from monim.lm.scoring import score_tokens
from monim.lm.token_scores import TokenScores
from monim.lm.windows import fit_window
from monim.theta.retriever import Article, ArticleIndex

SEPARATOR = "\n\n"  # between the article and the text it helps predict


def in_context(memory) -> bool:
    """Whether Θ reads text with an article before it (a memory of ralm or ralm+monim-amt)."""
    return memory is not None and memory.settings.policy.ralm_stride is not None


def articles_of(memory) -> ArticleIndex:
    """BM25 over the articles a memory holds as of its day."""
    return ArticleIndex.of(memory.ds, [(d.date, d.shard) for d in memory.days])


def reach(memory) -> int:
    """Tokens one pass reads at most: the memory's window (context + stride) and an article of up to
    `context` tokens, within the LM's positions."""
    w = memory.settings.window
    fitted = fit_window(memory.lm, replace(w, context=2 * w.context))
    return fitted.context + fitted.stride


@dataclass
class Pass:
    """What scoring with retrieval did: its batches, the LM's tokens read and the articles each text met."""

    batches: list[TokenScores] = field(default_factory=list)
    lm_tokens: int = 0
    scored: int = 0
    seconds: float = 0.0
    retrieved: dict[str, list[str]] = field(default_factory=dict)  # text id -> ids of the articles retrieved, in order


class Prefixes:
    """Articles as token ids before a text (each article tokenized once)."""

    def __init__(self, lm: LM):
        self.lm = lm
        self._ids: dict[str, list[int]] = {}  # article id -> its tokens
        self.separator = lm.tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]

    def of(self, article: Article | None, room: int) -> list[int]:
        """The article's first tokens and the separator, in at most `room` tokens ([] without an article)."""
        if article is None or room <= len(self.separator):
            return []
        if article.id not in self._ids:
            self._ids[article.id] = self.lm.tokenizer(f"{article.title}\n{article.text}".strip(),
                                                      add_special_tokens=False)["input_ids"]
        return self._ids[article.id][: room - len(self.separator)] + self.separator


def score_with_articles(lm: LM, memory, docs: list[Document], tokens: list[list[int]], keep_hidden: bool = False) -> Pass:
    """Score each document's tokens 1.. as In-Context RALM does with the memory's articles and settings:
    batches whose doc_id and position are the document's, as the LM alone scores them."""
    started = time.perf_counter()
    policy, fitted, size = memory.settings.policy, fit_window(lm, memory.settings.window), reach(memory)
    stride, query = policy.ralm_stride, policy.ralm_query
    context = fitted.context + fitted.stride - stride  # the text before a stride: as much as the LM alone reads
    index, prefixes = articles_of(memory), Prefixes(lm)
    plans: list[tuple[str, list[int], int, int]] = []  # (document, its tokens, first target, end)
    queries: list[list[int]] = []  # the tokens before each stride
    exclude: list[set[str]] = []
    for doc, toks in zip(docs, tokens):
        skip = index.twins_of(doc)
        for s in range(1, len(toks), stride):
            plans.append((doc.id, toks, s, min(s + stride, len(toks))))
            queries.append(toks[max(0, s - query) : s])
            exclude.append(skip)
    found = index.best(lm.tokenizer.batch_decode(queries), exclude)
    out = Pass()
    seqs, where = [], {}
    for k, ((doc_id, toks, s, e), article) in enumerate(zip(plans, found)):
        p = max(0, s - 1 - context)  # the stride's targets after `context` tokens before the first one's
        head = prefixes.of(article, size + 1 - (e - p))  # what is fed: all but the last target
        seqs.append((str(k), head + toks[p:e], len(head) + s - p))
        where[str(k)] = (doc_id, p - len(head))
        out.retrieved.setdefault(doc_id, []).append(article.id if article else "")
        out.lm_tokens += len(head) + e - p - 1
    cfg = replace(fitted, stride=stride, context=size - stride)
    for b in score_tokens(lm, seqs, cfg, keep_hidden=keep_hidden):
        doc_ids, offsets = zip(*(where[k] for k in b.doc_id))
        b.doc_id, b.position = np.array(doc_ids, dtype=object), (b.position + np.array(offsets)).astype(np.int32)
        out.batches.append(b)
        out.scored += len(b)
    out.seconds = time.perf_counter() - started
    return out


def with_article(lm: LM, memory, query: str, ids: list[int], room: int | None = None) -> tuple[list[int], Article | None]:
    """`ids` after the best article for `query` among the memory's, within `room` tokens in all
    (default: the memory's reach); the article, or None where none matched."""
    article = articles_of(memory).best([query])[0]
    head = Prefixes(lm).of(article, (room or reach(memory)) - len(ids))
    return head + ids, article if head else None
