"""Evaluation: perplexity and next-word accuracy of the bare LM and of LM + memory, per period.

Many memories (other policies, or one memory as of several days) are evaluated on the same
documents with one pass of the LM: its hidden states are kept per batch and searched in each.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from monim.knnlm import ThetaScores
from monim.lm import LM
from monim.features import Features, features_of
from monim.scoring import ScoreConfig, TokenScores, with_neighbors
from monim.memory import Memory
from monim.recency import Recency
from monim.stream import Document, iter_days, open_source

PERIODS = ("month", "week")


@dataclass
class EvalConfig:
    """What the evaluation suite measures after learning; None switches a measure off."""

    period: str | None = None  # "month" or "week": PPL on each period's test set as of each period's end
    period_docs: int | None = None  # test articles per period (spread over it); None: all
    text: str | None = None  # general-domain text (WikiText) for the forgetting probe
    text_chars: int | None = None  # only its first characters
    text_every: int = 7  # days between forgetting probes
    qa: str | None = None  # multiple-choice questions (JSONL), answered with the final memory
    shots: tuple[int, ...] = (0,)  # solved examples before each question
    qa_days_after: int = 7  # questions dated up to this many days after the last learned day count
    half_life: float | None = None  # recency (monim.recency): neighbours' kNN weight halves every half_life days of age
    max_age: int | None = None  # recency: entries older than this many days are not searched

    def __post_init__(self) -> None:
        if self.period not in (None, *PERIODS):
            raise ValueError(f"period must be one of {PERIODS}, got {self.period!r}")
        self.shots = tuple(int(k) for k in self.shots)
        self.recency = Recency(self.half_life, self.max_age)  # checks them


def period_of(date: dt.date, by: str) -> str:
    """The period a date falls in: '2022-06' by month, '2022-W23' by ISO week."""
    if by == "month":
        return f"{date:%Y-%m}"
    if by == "week":
        year, week, _ = date.isocalendar()
        return f"{year}-W{week:02d}"
    raise ValueError(f"period must be one of {PERIODS}, got {by!r}")


def period_sets(source: str, start: dt.date | None, end: dt.date | None, by: str, seed: int = 0,
              max_docs: int | None = None, split: str = "test") -> dict[str, list[Document]]:
    """Each period's held-out articles in date order; at most `max_docs`, spread evenly over it."""
    sets: dict[str, list[Document]] = {}
    for day in iter_days(open_source(source), start, end, seed):
        sets.setdefault(period_of(day.date, by), []).extend(day.split(split))
    if max_docs is not None:
        sets = {p: [docs[i] for i in np.unique(np.linspace(0, len(docs) - 1, max_docs).round().astype(int))]
                if len(docs) > max_docs else docs for p, docs in sets.items()}
    return sets


def text_document(path: str | Path, max_chars: int | None = None) -> Document:
    """A plain text file (e.g. WikiText's test set) as one document, optionally only its start."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    return Document(path.name, dt.date.min, path.read_text(encoding="utf-8")[:max_chars])


def searched(lm: LM, batch: TokenScores, memory: Memory | None) -> TokenScores:
    """A batch scored with keep_hidden, with the memory's neighbours (unchanged without a memory)."""
    if memory is None or not memory.retrieves:
        return batch
    return with_neighbors(lm, batch, memory.search)


def theta_of(batch: TokenScores, memory: Memory | None) -> ThetaScores:
    """Scores under Θ: the memory's interpolation, or the LM's own without a memory."""
    if memory is None or batch.knn_values is None:
        return ThetaScores(batch.logp.astype(np.float64), batch.max_logp.astype(np.float64), batch.argmax)
    return memory.theta_scores(batch)


class _Tally:
    """Running sums for PPL and accuracy, LM alone and Θ, over all tokens and over the tokens of
    novel articles (no near-duplicate among the memory's articles)."""

    def __init__(self) -> None:
        self.n, self.nll_lm, self.nll, self.hits_lm, self.hits = 0, 0.0, 0.0, 0, 0
        self.n_novel, self.nll_lm_novel, self.nll_novel = 0, 0.0, 0.0

    def add(self, b: TokenScores, theta: ThetaScores, novel: np.ndarray) -> None:
        lm = b.logp.astype(np.float64)
        self.n += len(b)
        self.nll_lm -= float(lm.sum())
        self.hits_lm += int((b.argmax == b.target).sum())
        self.nll -= float(theta.logp.sum())
        self.hits += int((theta.argmax == b.target).sum())
        self.n_novel += int(novel.sum())
        self.nll_lm_novel -= float(lm[novel].sum())
        self.nll_novel -= float(theta.logp[novel].sum())

    def result(self, skipped: int) -> dict:
        if not self.n:
            return {k: 0 if k == "tokens" else math.nan for k in (*PER_TOKEN, *PER_NOVEL_TOKEN, "tokens", "twin_share")}
        novel = {"ppl_novel": math.exp(self.nll_novel / self.n_novel), "ppl_lm_novel": math.exp(self.nll_lm_novel / self.n_novel)
                 } if self.n_novel else {"ppl_novel": math.nan, "ppl_lm_novel": math.nan}
        return {"tokens": self.n, "ppl_lm": math.exp(self.nll_lm / self.n), "ppl": math.exp(self.nll / self.n),
                "accuracy_lm": self.hits_lm / self.n, "accuracy": self.hits / self.n, "skipped": skipped / self.n,
                "twin_share": 1 - self.n_novel / self.n} | novel


PER_TOKEN = ("ppl_lm", "ppl", "accuracy_lm", "accuracy", "skipped")  # means over all tokens
PER_NOVEL_TOKEN = ("ppl_lm_novel", "ppl_novel")  # over the tokens of articles without a twin in memory


def combine(results: list[dict]) -> dict:
    """Several evaluations as one: token-weighted means (geometric for perplexities)."""
    results = [r for r in results if r.get("tokens")]
    n = sum(r["tokens"] for r in results)
    if not n:
        return _Tally().result(0)
    out = {"tokens": n, "twin_share": sum(r.get("twin_share", 0.0) * r["tokens"] for r in results) / n}
    for key in ("ppl_lm", "ppl"):
        out[key] = math.exp(sum(math.log(r[key]) * r["tokens"] for r in results) / n)
    for key in ("accuracy_lm", "accuracy", "skipped"):
        out[key] = sum(r.get(key, 0.0) * r["tokens"] for r in results) / n
    novel = [(r["tokens"] * (1 - r.get("twin_share", 0.0)), r) for r in results
             if not math.isnan(r.get("ppl_novel", math.nan))]
    n_novel = sum(w for w, _ in novel)
    for key in PER_NOVEL_TOKEN:
        out[key] = math.exp(sum(math.log(r[key]) * w for w, r in novel if w) / n_novel) if n_novel else math.nan
    return out


def evaluate_many(lm: LM, docs: list[Document], memories: dict, cfg: ScoreConfig | Features | None = None,
                  name: str = "eval") -> dict:
    """PPL and top-1 next-word accuracy of the LM alone and with each memory (None: the LM alone),
    the share of tokens whose article has a near-duplicate in the memory (`twin_share`) and PPL on
    the others (`ppl_novel`), and the share whose retrieval the skip rule skipped; the LM runs once."""
    for memory in memories.values():
        if memory is not None:
            memory.sync()
            memory.searched = memory.skipped = 0
    twins = {name: dict(zip((d.id for d in docs), memory.has_twin(docs))) if memory is not None else {}
             for name, memory in memories.items()}
    tallies = {name: _Tally() for name in memories}
    for batch in features_of(lm, cfg).scores(docs, name):
        for key, memory in memories.items():
            b = searched(lm, batch, memory)
            novel = ~np.array([twins[key].get(d, False) for d in b.doc_id], bool)
            tallies[key].add(b, theta_of(b, memory), novel)
    return {name: t.result(memories[name].skipped if memories[name] is not None else 0) for name, t in tallies.items()}


def evaluate(lm: LM, docs: list[Document], memory: Memory | None = None, cfg: ScoreConfig | Features | None = None,
             name: str = "eval") -> dict:
    """PPL and next-word accuracy of the LM alone and with one memory (Θ: its calibrator or constant λ)."""
    return evaluate_many(lm, docs, {"memory": memory}, cfg, name)["memory"]
