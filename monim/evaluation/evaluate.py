"""Evaluation: perplexity and next-word accuracy of the bare LM and of LM + memory.

Many memories (other policies, or one memory as of several days) are evaluated on the same
documents with one pass of the LM: its hidden states are kept per batch and searched in each.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from monim.core.config import ScoreConfig
from monim.data.feed import Document
from monim.evaluation.totals import nothing_scored
from monim.lm.features import Features
from monim.lm.model import LM
from monim.lm.scoring import with_neighbors
from monim.lm.token_scores import TokenScores
from monim.storage.memory_settings import SettingsMismatch, window_differences
from monim.theta.knnlm import ThetaScores
from monim.theta.memory import Memory
from monim.theta.ralm import Pass, articles_of, in_context, score_with_articles


def searched(lm: LM, batch: TokenScores, memory: Memory | None) -> TokenScores:
    """A batch scored with keep_hidden, with the memory's neighbours (unchanged without a memory)."""
    if memory is None or not memory.retrieves:
        return batch
    if memory.searched_on_device:  # Θ's scores computed there, the neighbours left there
        return with_neighbors(lm, batch, memory.on_device(neighbors=False))
    return with_neighbors(lm, batch, memory.search, at_once=memory.at_once)


def theta_of(batch: TokenScores, memory: Memory | None) -> ThetaScores:
    """Scores under Θ of a batch `searched` in the memory: those computed on the device there, the
    memory's interpolation, or the LM's own (no memory, or one Θ does not search)."""
    if memory is None or not memory.retrieves:
        return ThetaScores(batch.logp.astype(np.float64), batch.max_logp.astype(np.float64), batch.argmax)
    if (memory.searched_on_device and batch.theta_logp is not None and batch.theta_max_logp is not None
            and batch.theta_argmax is not None):  # made by `searched` for this memory
        return ThetaScores(batch.theta_logp, batch.theta_max_logp, batch.theta_argmax)
    if batch.knn_values is None:
        return ThetaScores(batch.logp.astype(np.float64), batch.max_logp.astype(np.float64), batch.argmax)
    return memory.theta_scores(batch)


class _Tally:
    """Running sums for PPL and accuracy, LM alone and Θ, over all tokens and over the tokens of
    novel articles (no near-duplicate among the memory's articles)."""

    def __init__(self) -> None:
        self.n, self.nll_lm, self.nll, self.hits_lm, self.hits, self.skipped = 0, 0.0, 0.0, 0, 0, 0
        self.n_novel, self.nll_lm_novel, self.nll_novel = 0, 0.0, 0.0

    def add(self, b: TokenScores, theta: ThetaScores, novel: np.ndarray) -> None:
        self.add_lm(b, novel)
        self.add_theta(b, theta, novel)

    def add_lm(self, b: TokenScores, novel: np.ndarray) -> None:
        """The LM alone's half: where Θ read the tokens in other passes (In-Context RALM's), they come apart."""
        lm = b.logp.astype(np.float64)
        self.nll_lm -= float(lm.sum())
        self.hits_lm += int((b.argmax == b.target).sum())
        self.nll_lm_novel -= float(lm[novel].sum())

    def add_theta(self, b: TokenScores, theta: ThetaScores, novel: np.ndarray) -> None:
        self.n += len(b)
        self.nll -= float(theta.logp.sum())
        self.hits += int((theta.argmax == b.target).sum())
        self.skipped += 0 if b.knn_skipped is None else int(b.knn_skipped.sum())
        self.n_novel += int(novel.sum())
        self.nll_novel -= float(theta.logp[novel].sum())

    def result(self) -> dict:
        if not self.n:
            return nothing_scored()
        novel = {"ppl_novel": math.exp(self.nll_novel / self.n_novel), "ppl_lm_novel": math.exp(self.nll_lm_novel / self.n_novel)
                 } if self.n_novel else {"ppl_novel": math.nan, "ppl_lm_novel": math.nan}
        return {"tokens": self.n, "ppl_lm": math.exp(self.nll_lm / self.n), "ppl": math.exp(self.nll / self.n),
                "accuracy_lm": self.hits_lm / self.n, "accuracy": self.hits / self.n, "skipped": self.skipped / self.n,
                "twin_share": 1 - self.n_novel / self.n} | novel


def shared_features(lm: LM, memories: dict, features: Features | None) -> Features:
    """The LM's view of documents that every memory reads (they must share a window): as given, or live."""
    readers = [m for m in memories.values() if m is not None]
    features = features or Features(lm, readers[0].settings.window if readers else ScoreConfig())
    for memory in readers:
        differ = window_differences(memory.settings.window, features.cfg)
        if differ:
            raise SettingsMismatch(f"{memory.ds.root} was learned with {differ}; these features were not")
    return features


def evaluate_many(lm: LM, docs: list[Document], memories: dict, features: Features | None = None,
                  name: str = "eval") -> dict:
    """PPL and top-1 next-word accuracy of the LM alone and with each memory (None: the LM alone),
    the share of tokens whose article has a near-duplicate in the memory (`twin_share`) and PPL on
    the others (`ppl_novel`), and the share whose retrieval the skip rule skipped; the LM runs once,
    under the memories' window (`features`: from a feature store, if given)."""
    features = shared_features(lm, memories, features)
    for memory in memories.values():
        if memory is not None:
            memory.sync()
    twins = {name: dict(zip((d.id for d in docs), memory.has_twin(docs))) if memory is not None else {}
             for name, memory in memories.items()}
    novel = lambda key, b: ~np.array([twins[key].get(d, False) for d in b.doc_id], bool)  # noqa: E731
    tallies = {name: _Tally() for name in memories}
    for batch in features.scores(docs, name):
        for key, memory in memories.items():
            if in_context(memory):
                tallies[key].add_lm(batch, novel(key, batch))
                continue
            b = searched(lm, batch, memory)
            tallies[key].add(b, theta_of(b, memory), novel(key, batch))
    out: dict[str, dict[str, float]] = {name: {} for name in memories}
    for key, ralm in in_context_passes(lm, memories, docs, features).items():
        for b in ralm.batches:
            b = searched(lm, b, memories[key])
            tallies[key].add_theta(b, theta_of(b, memories[key]), novel(key, b))
        out[key] = {"lm_tokens_per_token": ralm.lm_tokens / max(ralm.scored, 1), "ralm_seconds": ralm.seconds}
    return {name: t.result() | out[name] for name, t in tallies.items()}


def in_context_passes(lm: LM, memories: dict, docs: list[Document], features: Features) -> dict[str, Pass]:
    """In-Context RALM's passes over the documents for each memory that reads text so; memories that
    retrieve from the same articles with the same settings (ralm and ralm+monim-amt) share one."""
    groups: dict[tuple, list[str]] = {}
    for key, memory in memories.items():
        if in_context(memory):
            p = memory.settings.policy
            ids = tuple(a.id for a in articles_of(memory).articles)
            w = memory.settings.window
            groups.setdefault((ids, p.ralm_stride, p.ralm_query, w.context, w.stride), []).append(key)
    tokens = features.tokenize(docs) if groups else []
    out: dict[str, Pass] = {}
    for keys in groups.values():
        ralm = score_with_articles(lm, memories[keys[0]], docs, tokens, any(memories[k].retrieves for k in keys))
        out |= {k: ralm for k in keys}
    return out


def evaluate(lm: LM, docs: list[Document], memory: Memory | None = None, features: Features | None = None,
             name: str = "eval") -> dict:
    """PPL and next-word accuracy of the LM alone and with one memory (Θ: its calibrator or constant λ)."""
    return evaluate_many(lm, docs, {"memory": memory}, features, name)["memory"]


def score_texts(lm: LM, docs: list[Document], memory: Memory | None = None, features: Features | None = None) -> dict:
    """Each document's PPL under Θ and under the LM alone, and its tokens: {doc id: metrics}; the LM
    runs once over all of them (packed rows), each document seeing only itself."""
    features = shared_features(lm, {"memory": memory}, features)
    if memory is not None:
        memory.sync()
    tallies = {d.id: _Tally() for d in docs}
    ralm = in_context_passes(lm, {"memory": memory}, docs, features).get("memory")

    def add(b: TokenScores, lm_half: bool, theta_half: bool) -> None:
        theta = theta_of(b, memory) if theta_half else None
        for doc_id in np.unique(b.doc_id):
            rows, tally = b.doc_id == doc_id, tallies[doc_id]
            mine, every = _rows(b, rows), np.ones(int(rows.sum()), bool)
            if lm_half:
                tally.add_lm(mine, every)
            if theta is not None:
                tally.add_theta(mine, ThetaScores(theta.logp[rows], theta.max_logp[rows], theta.argmax[rows]), every)

    for batch in features.scores(docs, "texts"):
        add(batch if ralm else searched(lm, batch, memory), True, not ralm)
    for b in ralm.batches if ralm else ():
        add(searched(lm, b, memory), False, True)
    return {doc_id: {k: t.result()[k] for k in ("ppl", "ppl_lm", "tokens")} for doc_id, t in tallies.items()}


def _rows(batch: TokenScores, rows: np.ndarray) -> TokenScores:
    """Some rows of a searched batch, neighbours included."""
    picked: dict[str, Any] = {f: None if v is None else v[rows] for f, v in vars(batch).items()}
    return TokenScores(**picked)
