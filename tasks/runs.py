"""The stages of a day that differ by the run's kind (monim.run): learn (memorize and calibrate, or
train), evaluate, register."""

from __future__ import annotations

import time

from prefect import task

from monim.catalogue import LEARNER, MEMORY
from monim.config import RunConfig
from monim.lm import cached_lm
from monim.run import MemoryRun
from monim.stream import Day
from tasks.learning import calibrate, memorize, run_for, train
from tasks.logs import logger


def learn(cfg: RunConfig, day: Day, step: int) -> dict:
    """Learn the day as the run's kind does, each stage a task: memorize and calibrate, or train; the day's row."""
    if cfg.kind == MEMORY:
        stats = memorize(cfg, day)
        return MemoryRun.learned(stats, calibrate(cfg, day) if run_for(cfg).calibrates else {})
    if cfg.kind == LEARNER:
        return run_for(cfg).trained(train(cfg, day, step))
    return {}


def register(cfg: RunConfig, day: Day, run_id: str, uri: str) -> dict:
    """Register what the run predicts with as of the day (a memory's Θ) in the model registry."""
    if cfg.kind != MEMORY:
        return {}
    from tasks.gate import register_day  # MLflow's model registry: only where a run is logged

    return register_day(cfg, day, run_for(cfg).memory.at(day.date.isoformat()), run_id, uri)


def _evaluation_key(context, parameters: dict) -> str:
    """Cache key: the day, the run's settings (the LM's dtype as "auto" resolved it on this machine)
    and the state of what the run predicts with, never tensors."""
    cfg = parameters["cfg"]
    dtype = cached_lm(cfg.model, cfg.dtype).dtype
    return f"monim-eval-{cfg.fingerprint()}-{dtype}-{parameters['date']}-{parameters['state']}"


@task(cache_key_fn=_evaluation_key, persist_result=True)
def evaluate(cfg: RunConfig, date: str, state: str, day: Day) -> dict:
    """Test PPL and next-word accuracy of the LM alone and of the run as of the day (its `state`),
    on the day's test articles."""
    started = time.perf_counter()
    metrics = run_for(cfg).evaluate(day)
    logger().info("%s %s: test PPL %.2f (LM alone %.2f), accuracy %.3f", cfg.name, date, metrics["ppl"],
                  metrics["ppl_lm"], metrics["accuracy"])
    return metrics | {"evaluate_seconds": time.perf_counter() - started}
