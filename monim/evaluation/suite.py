"""The evaluation suite: PPL on each period's test articles (as of each period's end and every later
one: the forgetting matrix), PPL on a general-domain text (the forgetting probe) and multiple-choice
QA, for many runs at once (the suite after learning) or one memory (`monim eval`), by one rule.

A view is (LM, its features, {key: memory or None}): every memory of a view is searched with the
hidden states of one LM pass (None: the LM alone).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Callable, Hashable, Iterable, Literal

import numpy as np

from monim.core.config import EvalConfig, period_of
from monim.data.feed import Document, Fields, open_feed
from monim.data.stream import iter_days
from monim.evaluation.evaluate import evaluate_many
from monim.evaluation.qa import answer_questions, read_questions
from monim.evaluation.totals import combine
from monim.lm.features import Features
from monim.lm.model import LM

View = tuple[LM, Features, dict]

def period_sets(source: str, start: dt.date | None, end: dt.date | None, by: str, seed: int = 0,
                max_docs: int | None = None, split: str = "test", fields: Fields | None = None,
                on_error: Literal["raise", "skip"] = "raise") -> dict[str, list[Document]]:
    """Each period's held-out articles in date order; at most `max_docs`, spread evenly over it."""
    sets: dict[str, list[Document]] = {}
    for day in iter_days(open_feed(source, fields), start, end, seed, on_error):
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


def period_results(views: Iterable[View], sets: dict[str, list[Document]],
                   asked: Callable[[Hashable, str], bool] = lambda key, period: True) -> dict[str, dict]:
    """{period: {key: metrics}}: each period's articles under the memories `asked` about it."""
    out: dict[str, dict] = {}
    for lm, features, memories in views:
        for period, docs in sets.items():
            cells = {key: m for key, m in memories.items() if asked(key, period)}
            if cells and docs:
                out.setdefault(period, {}).update(evaluate_many(lm, docs, cells, features, f"period-{period}"))
    return out


def text_results(views: Iterable[View], doc: Document) -> dict:
    """{key: metrics} on one text."""
    out: dict = {}
    for lm, features, memories in views:
        out |= evaluate_many(lm, [doc], memories, features, f"text-{doc.id}")
    return out


def qa_results(views: Iterable[View], path: str, first: dt.date | None, last: dt.date | None, e: EvalConfig) -> dict[int, dict]:
    """{shots: {key: accuracy, interval, n}} on the questions of the window a run learned from
    `first` to `last` is asked (EvalConfig.qa_window); solved examples come from the whole file."""
    questions, pool = read_questions(path, *e.qa_window(first, last)), read_questions(path)
    out: dict[int, dict] = {}
    for lm, features, memories in views:
        for k in e.shots:
            out.setdefault(k, {}).update(answer_questions(lm, questions, memories, k, pool, features.cfg))
    return out


def evaluate_memory(memory, e: EvalConfig, source: str | None = None, start: dt.date | None = None,
                    end: dt.date | None = None, split: str = "test", features: Features | None = None,
                    fields: Fields | None = None) -> dict:
    """`monim eval`: one memory (as of its day) beside the LM alone, by the suite's rules: PPL on a
    source's articles overall and per period (e.period), on a text (e.text), and QA accuracy on the
    questions of the memory's window (e.qa)."""
    features = features or memory.features()
    view = [(memory.lm, features, {"memory": memory, "lm": None})]
    days = memory.days
    first, last = (dt.date.fromisoformat(days[0].date), dt.date.fromisoformat(days[-1].date)) if days else (None, None)
    if e.qa is not None and not read_questions(e.qa, *e.qa_window(first, last)):  # before any scoring
        raise ValueError(f"{e.qa} has no questions dated {first}..{e.qa_window(first, last)[1]} (the memory's days "
                         f"and {e.qa_days_after} days after)")
    result: dict = {"policy": memory.ds.root.name, "as_of": days[-1].date if days else None, "entries": len(memory)}
    if source is not None:
        sets = period_sets(source, start, end, e.period or "month", split=split, fields=fields)
        by = {p: r["memory"] for p, r in period_results(view, sets).items()}
        result |= combine(list(by.values())) | {"documents": sum(len(d) for d in sets.values()),
                                                f"ppl_by_{e.period}": {p: r["ppl"] for p, r in by.items()},
                                                f"ppl_lm_by_{e.period}": {p: r["ppl_lm"] for p, r in by.items()}}
    if e.text is not None:
        r = text_results(view, text_document(e.text, e.text_chars))["memory"]
        result |= {"ppl_text": r["ppl"], "ppl_text_lm": r["ppl_lm"], "text_tokens": r["tokens"]}
    if e.qa is not None:
        for k, answers in qa_results(view, e.qa, first, last, e).items():
            result |= answers["memory"] | {"qa_accuracy_lm": answers["lm"]["qa_accuracy"], "qa_shots": k}
    return result
