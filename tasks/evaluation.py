"""Tasks of the evaluation suite: per-period PPL as of each period's end, the forgetting probe, QA.

Each task evaluates every run at once (memories read as of past days, without copies), so the LM
scores each text once; results are cached on the memories' state and the suite's settings.
"""

from __future__ import annotations

import datetime as dt
import json

from prefect import task

from monim.config import BARE, RunConfig
from monim.evaluate import EvalConfig, evaluate_many, period_of, period_sets, text_document
from monim.memory import Memory
from monim.qa import answer_questions, read_questions
from tasks.learning import features_for, lm_for, logger, memory_for


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


def _memories(configs: list[RunConfig], days: list[str], e: EvalConfig) -> dict[tuple[str, str], Memory | None]:
    """Each run's memory as of each day, under the suite's recency rule (None for the bare LM)."""
    out = {}
    for cfg in configs:
        memory = None if cfg.policy == BARE else memory_for(cfg).recent(e.recency)
        out |= {(cfg.name, day): memory and memory.at(day) for day in days}
    return out


def _suite_key(context, parameters: dict) -> str:
    """Cache key: the runs' settings and memories' states, the days and the suite's settings."""
    states = []
    for cfg in parameters["configs"]:
        manifest = cfg.memory_dir / "manifest.json"
        version = json.loads(manifest.read_text()).get("version") if manifest.exists() else 0
        states.append(f"{cfg.fingerprint()}:{version}")
    rest = {k: v for k, v in parameters.items() if k != "configs"}
    return f"monim-{context.task.name}-" + json.dumps([states, rest], sort_keys=True, default=str)


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
    memories = _memories(configs, days, e)
    out: dict[str, dict] = {}
    for period, docs in sets.items():
        cells = {key: m for key, m in memories.items() if period_of(dt.date.fromisoformat(key[1]), e.period) >= period}
        if not cells:
            continue
        out[period] = _cells(evaluate_many(lm_for(cfg.model, cfg.dtype), docs, cells, features_for(cfg), f"period-{period}"))
        logger().info("%s: %d test articles, PPL by run and day: %s", period, len(docs),
                      {n: {d: round(r["ppl"], 2) for d, r in days_.items()} for n, days_ in out[period].items()})
    return out


@task(cache_key_fn=_suite_key, persist_result=True)
def text_perplexity(configs: list[RunConfig], days: list[str], e: EvalConfig) -> dict:
    """The forgetting probe: PPL of each run on a general-domain text, as of each probe day."""
    doc = text_document(e.text, e.text_chars)
    cfg = configs[0]
    results = _cells(evaluate_many(lm_for(cfg.model, cfg.dtype), [doc], _memories(configs, days, e), features_for(cfg), f"text-{doc.id}"))
    logger().info("forgetting probe on %s: %s", doc.id, {n: {d: round(m["ppl"], 2) for d, m in r.items()} for n, r in results.items()})
    return results


@task(cache_key_fn=_suite_key, persist_result=True)
def question_answering(configs: list[RunConfig], first: str, last: str, e: EvalConfig) -> dict:
    """Multiple-choice accuracy of each run's final memory on the questions dated from its first
    learned day to `qa_days_after` days after its last, for each number of shots."""
    until = dt.date.fromisoformat(last) + dt.timedelta(days=e.qa_days_after)
    questions = read_questions(e.qa, dt.date.fromisoformat(first), until)
    pool = read_questions(e.qa)
    memories = {name: m for (name, _), m in _memories(configs, [last], e).items()}
    out: dict[str, dict] = {}
    for k in e.shots:
        for name, metrics in answer_questions(lm_for(configs[0].model, configs[0].dtype), questions, memories, k, pool).items():
            out.setdefault(name, {})[k] = metrics
        logger().info("QA %d-shot on %d questions: %s", k, len(questions), {n: round(r[k]["qa_accuracy"], 3) for n, r in out.items()})
    return out
