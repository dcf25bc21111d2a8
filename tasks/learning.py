"""Tasks of one streaming day (the steps of monim.run.Run.day, called in order by the day flow,
flows.day): ingest, featurize, memorize (and update the index), calibrate; or, for a parametric
learner, train the weights; and record the day. Each is one call on the run it is handed
(monim.run.open_run opens it once per process), with its retries, progress and log lines."""

from __future__ import annotations

import datetime as dt
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from monim.core.run_config import RunConfig
from monim.data.day import Day
from monim.data.feed import Document
from monim.lm.features import Features
from monim.lm.model import cached_lm
from monim.run import LearnerRun, MemoryRun, Run
from monim.theta.knnlm import RULES
from tasks.cluster import stage
from tasks.logs import logger

LOG_EVERY = 25  # percent: without a terminal, progress is a log line at every this many percent


@contextmanager
def progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A stage's progress as (tokens done, tokens in all): a bar with tokens/s on a terminal, else a
    log line every LOG_EVERY%; and a Prefect progress artifact."""
    artifact = create_progress_artifact(0.0, description=description)
    bar = tqdm(desc=description, unit="tok", unit_scale=True, mininterval=1.0, leave=False) if sys.stderr.isatty() else None
    started, said = time.perf_counter(), [0]

    def update(done: int, total: int) -> None:
        percent = 100.0 * done / max(total, 1)
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)
        elif percent >= said[0] + LOG_EVERY:
            said[0] = int(percent // LOG_EVERY * LOG_EVERY)
            logger().info("%s: %d%% (%s of %s tokens, %.0f tokens/s)", description, percent, f"{done:,}", f"{total:,}",
                          done / max(time.perf_counter() - started, 1e-9))
        update_progress_artifact(artifact, percent)  # type: ignore[arg-type]  # sync here: a UUID, not a coroutine

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
        update_progress_artifact(artifact, 100.0)  # type: ignore[arg-type]


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def ingest(run: Run, date: dt.date, since: dt.date | None = None) -> Day:
    """Read the day's news slice (once: the other tasks are handed it) and report its split sizes."""
    day = run.ingest(date, since)
    logger().info("%s: %s", date, day.counts())
    if day.forgotten:
        logger().warning("%s: %d article(s) the memory forgot, not learned: %s", date, len(day.forgotten),
                         "; ".join(f"{doc_id}: {why}" for doc_id, why in day.forgotten))
    return day


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize(run: Run, day: Day) -> dict:
    """Run the LM over the day's articles of the run's splits that the feature store lacks (no-op without a store)."""
    done = run.featurize(day, progress=progress)
    if done["tokens"]:
        logger().info("%s: the LM scored %d tokens in %.0f s (%.0f tokens/s)", day.date, done["tokens"], done["seconds"],
                      done["tokens"] / done["seconds"])
    return done


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize_part(cfg: RunConfig, docs: list[Document], name: str) -> dict:
    """On a cluster's worker: run the LM (loaded once per worker process) over one part of a day's
    articles into the shared feature store."""
    started = time.perf_counter()
    tokens = Features.of(cfg, cached_lm(cfg.model, cfg.dtype)).prepare(docs, name)
    return {"tokens": tokens, "seconds": time.perf_counter() - started, "worker": f"{socket.gethostname()}:{os.getpid()}"}


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def memorize(run: MemoryRun, day: Day) -> dict:
    """Score the day with Θ, memorize through the policy, commit atomically (idempotent)."""
    cfg = run.cfg
    with progress(f"{cfg.name}: memorizing {day.date}") as update, stage("decision search"):
        stats = run.memorize(day, update)
    if stats["committed"]:
        logger().info("%s %s: stored %d of %d tokens (MemRate %.1f%%); index: %s", cfg.name, day.date, stats["stored"],
                      stats["tokens_seen"], 100 * stats["memrate"], stats["index"])
    else:
        logger().info("%s %s: already in memory, nothing changed", cfg.name, day.date)
    return stats


@task(retries=1, cache_policy=NO_CACHE)
def train(run: LearnerRun, day: Day, index: int) -> dict:
    """A parametric learner's day: train the previous day's weights on the day's training articles
    (the stream's `index`-th day, for Mix-Review's decay) and commit them (a trained day is kept as it is)."""
    cfg = run.cfg
    meta = run.train(day, index)
    if meta.pop("already", False):
        logger().info("%s %s: already trained, nothing changed", cfg.name, day.date)
    else:
        logger().info("%s %s: trained on %d tokens (+%d review) in %d steps, loss %.3f, %.0f s", cfg.name, day.date,
                      meta["tokens_trained"], meta["review_tokens"], meta["steps"], meta["train_loss"], meta["seconds_train"])
    return meta


@task(retries=1, cache_policy=NO_CACHE)
def calibrate(run: MemoryRun, day: Day) -> dict:
    """Add the day's calibration examples, tune the constant λ, T and train the NN calibrator
    (idempotent per day); say so when tomorrow's Θ falls back to the LM alone."""
    cfg = run.cfg
    with stage("calibration search"):
        out = run.calibrate(day)
    summary, rule = out["summary"], run.memory.rule
    if summary["trained"]:
        nll = summary.get("nll") or {}
        logger().info("calibrated on %d tokens (%s): constant λ=%.2f T=%g, λ on copies %.2f; held-out NLL on new text: %s; "
                      "on held contexts: %s; Θ's rule: %s", summary["calibration_tokens"], summary["source"], summary["lam"],
                      summary["temperature"], summary["lam_copy"], _rounded(nll), _rounded(nll.get("seen") or {}), rule)
    if rule == "lm":
        logger().warning("%s %s: Θ is worse than the LM on %d held-out tokens: tomorrow's Θ falls back to the LM alone",
                         cfg.name, day.date, run.memory.theta()["nll"]["tokens"])
    return out


def _rounded(nll: dict) -> dict:
    return {r: round(v, 3) for r, v in nll.items() if r in RULES and v is not None}


@task(cache_policy=NO_CACHE)
def record_day(run: Run, row: dict) -> None:
    """Record a finished day's row in the memory's manifest and the run's rows (atomically); the
    stream resumes after it."""
    run.record(row)
