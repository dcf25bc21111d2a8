"""Tasks of the evaluation suite: per-period PPL as of each period's end, the forgetting probe, QA.

Each task evaluates every memory at once (read as of past days, without copies), so the frozen LM
scores each text once; a parametric learner's weights of each day score it on their own. Results
are cached on the runs' state and the suite's settings.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Iterator

from prefect import task

from monim.config import BARE, RunConfig
from monim.evaluate import EvalConfig, evaluate_many, period_of, period_sets, text_document
from monim.features import Features
from monim.lm import LM
from monim.parametric import Weights
from monim.scoring import ScoreConfig
from monim.qa import answer_questions, read_questions
from tasks.learning import features_for, lm_for, logger, memory_for, scorer


def checkpoint_days(dates: list[str], ecfg: EvalConfig) -> dict[str, list[str]]:
    """When each measure is taken: the last learned day of each period; every `text_every` days
    (and the last day) for the forgetting probe; the last day for QA."""
    dates = sorted(dates)
    ends: dict[str, str] = {}
    if ecfg.period:
        for d in dates:
            ends[period_of(dt.date.fromisoformat(d), ecfg.period)] = d
    probes = sorted({*dates[ecfg.text_every - 1 :: ecfg.text_every], dates[-1]}) if dates else []
    return {"periods": sorted(ends.values()), "text": probes, "qa": dates[-1:]}


def _views(configs: list[RunConfig], days: list[str], e: EvalConfig) -> Iterator[tuple[LM, Features | ScoreConfig, dict]]:
    """Who scores what, as (LM, how to score, {(run, day): memory or None}): the frozen LM once for
    every memory run as of each day, under the suite's recency rule (None: the bare LM); then each
    parametric run's weights as of each day, loaded one at a time."""
    frozen = {}
    for cfg in configs:
        if not cfg.parametric:
            memory = None if cfg.policy == BARE else memory_for(cfg).recent(e.recency)
            frozen |= {(cfg.name, day): memory and memory.at(day) for day in days}
    if frozen:
        yield lm_for(configs[0].model, configs[0].dtype), features_for(configs[0]), frozen
    for cfg in (c for c in configs if c.parametric):
        for day in days:
            yield *scorer(cfg, day), {(cfg.name, day): None}


def _suite_key(context, parameters: dict) -> str:
    """Cache key: the runs' settings and memories' states, the days and the suite's settings."""
    states = []
    for cfg in parameters["configs"]:
        manifest = cfg.memory_dir / "manifest.json"
        version = json.loads(manifest.read_text()).get("version") if manifest.exists() else 0
        if cfg.parametric:
            version = Weights(cfg.weights_dir).days()[-1:]
        states.append(f"{cfg.fingerprint()}:{version}")
    rest = {k: v for k, v in parameters.items() if k != "configs"}
    # hashed: the key names a file, and seven runs' states with the suite's settings pass 255 characters
    key = json.dumps([states, rest], sort_keys=True, default=str)
    return f"monim-{context.task.name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def _cells(results: dict) -> dict[str, dict[str, dict]]:
    """{(run, day): metrics} as {run: {day: metrics}}."""
    out: dict[str, dict[str, dict]] = {}
    for (name, day), metrics in results.items():
        out.setdefault(name, {})[day] = metrics
    return out


@task(cache_key_fn=_suite_key, persist_result=True)
def period_perplexity(configs: list[RunConfig], source: str, start: str, end: str, days: list[str], e: EvalConfig) -> dict:
    """PPL and next-word accuracy on each period's test articles, with each run's memory as of the
    end of that period and of every later one (the lower triangle of the forgetting matrix)."""
    cfg = configs[0]
    sets = period_sets(source, dt.date.fromisoformat(start), dt.date.fromisoformat(end), e.period, cfg.seed, e.period_docs)
    results: dict[str, dict] = {}
    for lm, scoring, memories in _views(configs, days, e):
        for period, docs in sets.items():
            cells = {key: m for key, m in memories.items() if period_of(dt.date.fromisoformat(key[1]), e.period) >= period}
            if cells:
                results.setdefault(period, {}).update(evaluate_many(lm, docs, cells, scoring, f"period-{period}"))
    out: dict[str, dict] = {}
    for period, docs in sets.items():
        if period not in results:
            continue
        out[period] = _cells(results[period])
        logger().info("%s: %d test articles, PPL by run and day: %s", period, len(docs),
                      {n: {d: round(r["ppl"], 2) for d, r in days_.items()} for n, days_ in out[period].items()})
    return out


@task(cache_key_fn=_suite_key, persist_result=True)
def text_perplexity(configs: list[RunConfig], days: list[str], e: EvalConfig) -> dict:
    """The forgetting probe: PPL of each run on a general-domain text, as of each probe day."""
    doc = text_document(e.text, e.text_chars)
    cells: dict = {}
    for lm, scoring, memories in _views(configs, days, e):
        cells |= evaluate_many(lm, [doc], memories, scoring, f"text-{doc.id}")
    results = _cells(cells)
    logger().info("forgetting probe on %s: %s", doc.id, {n: {d: round(m["ppl"], 2) for d, m in r.items()} for n, r in results.items()})
    return results


@task(cache_key_fn=_suite_key, persist_result=True)
def question_answering(configs: list[RunConfig], first: str, last: str, e: EvalConfig) -> dict:
    """Multiple-choice accuracy of each run's final memory on the questions dated from its first
    learned day to `qa_days_after` days after its last, for each number of shots."""
    until = dt.date.fromisoformat(last) + dt.timedelta(days=e.qa_days_after)
    questions = read_questions(e.qa, dt.date.fromisoformat(first), until)
    pool = read_questions(e.qa)
    out: dict[str, dict] = {}
    for k in e.shots:
        for lm, _, memories in _views(configs, [last], e):
            named = {name: m for (name, _), m in memories.items()}
            for name, metrics in answer_questions(lm, questions, named, k, pool).items():
                out.setdefault(name, {})[k] = metrics
        logger().info("QA %d-shot on %d questions: %s", k, len(questions), {n: round(r[k]["qa_accuracy"], 3) for n, r in out.items()})
    return out
