"""Tasks of one streaming day: ingest, featurize, memorize (and update the index), calibrate; or, for
a parametric learner, train the weights; and the run records a stream resumes from."""

from __future__ import annotations

import datetime as dt
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from monim import workdirs
from monim.config import RunConfig
from monim.knnlm import RULES
from monim.lm import cached_lm
from monim.run import Run, make_run
from monim.sources import Document
from monim.stream import Day, read_day
from tasks.logs import logger


_OPEN: dict[tuple[str, str], Run] = {}  # (work directory, run name) -> the run open in this process
_OPENING = threading.Lock()  # a Dask worker's (or a task runner's) threads ask for the same run at once


def run_for(cfg: RunConfig) -> Run:
    """The run `cfg` names, as this process has it open (monim.run): opened at its first task, again
    when its settings change; every task of the run acts on it, whichever thread runs the task."""
    key = (str(Path(cfg.workdir).resolve()), cfg.name)
    with _OPENING:
        if key not in _OPEN or _OPEN[key].cfg != cfg:
            _OPEN[key] = make_run(cfg)
        return _OPEN[key]


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
        update_progress_artifact(artifact, percent)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
        update_progress_artifact(artifact, 100.0)


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def ingest(cfg: RunConfig, date: str, since: str | None = None) -> Day:
    """Read the day's news slice (once: the other tasks are handed it), with the records of the days
    from `since` that hold no article, its training articles capped at the run's `max_docs` (the one
    place the cap applies), and report its split sizes; an id the memory read on another day is a bad record."""
    day = read_day(cfg.source, dt.date.fromisoformat(date), cfg.seed, cfg.on_error, cfg.fields(),
                   dt.date.fromisoformat(since) if since else None, workdirs.known_ids(workdirs.memory_root(cfg.workdir, cfg.name)))
    if day is None:
        raise ValueError(f"{cfg.source} has no articles on {date}")
    day = day.capped(cfg.max_docs).truncate(cfg.max_article_tokens, cached_lm(cfg.model, cfg.dtype).cut)
    logger().info("%s: %s", date, day.counts())
    return day


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize(cfg: RunConfig, day: Day, splits: tuple[str, ...]) -> dict:
    """Run the LM over the day's articles of these splits that the feature store lacks (no-op without a store)."""
    done = run_for(cfg).featurize(day, splits, progress)
    if done["tokens"]:
        logger().info("%s: the LM scored %d tokens in %.0f s (%.0f tokens/s)", day.date, done["tokens"], done["seconds"],
                      done["tokens"] / done["seconds"])
    return done


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize_part(cfg: RunConfig, docs: list[Document], name: str) -> dict:
    """On a cluster's worker: run the LM (loaded once per worker process) over one part of a day's
    articles into the shared feature store."""
    started = time.perf_counter()
    tokens = run_for(cfg).features.prepare(docs, name)
    return {"tokens": tokens, "seconds": time.perf_counter() - started, "worker": f"{socket.gethostname()}:{os.getpid()}"}


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def memorize(cfg: RunConfig, day: Day) -> dict:
    """Score the day with Θ, memorize through the policy, commit atomically (idempotent)."""
    with progress(f"{cfg.name}: memorizing {day.date}") as update:
        stats = run_for(cfg).memorize(day, update)
    if stats["committed"]:
        logger().info("%s %s: stored %d of %d tokens (MemRate %.1f%%); index: %s", cfg.name, day.date, stats["stored"],
                      stats["tokens_seen"], 100 * stats["memrate"], stats["index"])
    else:
        logger().info("%s %s: already in memory, nothing changed", cfg.name, day.date)
    return stats


@task(retries=1, cache_policy=NO_CACHE)
def train(cfg: RunConfig, day: Day, index: int) -> dict:
    """A parametric learner's day: train the previous day's weights on the day's training articles
    (the stream's `index`-th day, for Mix-Review's decay) and commit them (a trained day is kept as it is)."""
    meta = run_for(cfg).train(day, index)
    if meta.pop("already", False):
        logger().info("%s %s: already trained, nothing changed", cfg.name, day.date)
    else:
        logger().info("%s %s: trained on %d tokens (+%d review) in %d steps, loss %.3f, %.0f s", cfg.name, day.date,
                      meta["tokens_trained"], meta["review_tokens"], meta["steps"], meta["train_loss"], meta["seconds_train"])
    return meta


@task(retries=1, cache_policy=NO_CACHE)
def calibrate(cfg: RunConfig, day: Day) -> dict:
    """Add the day's calibration examples, tune the constant λ, T and train the NN calibrator
    (idempotent per day); say so when tomorrow's Θ falls back to the LM alone."""
    run = run_for(cfg)
    out = run.calibrate(day)
    record, rule = out["record"], run.memory.rule
    if record["trained"]:
        nll = record.get("nll") or {}
        logger().info("calibrated on %d tokens (%s): constant λ=%.2f T=%g, λ on copies %.2f; held-out NLL on new text: %s; "
                      "on held contexts: %s; Θ's rule: %s", record["calibration_tokens"], record["source"], record["lam"],
                      record["temperature"], record["lam_copy"], _rounded(nll), _rounded(nll.get("seen") or {}), rule)
    if rule == "lm":
        logger().warning("%s %s: Θ is worse than the LM on %d held-out tokens: tomorrow's Θ falls back to the LM alone",
                         cfg.name, day.date, run.memory.theta()["nll"]["tokens"])
    return out


def _rounded(nll: dict) -> dict:
    return {r: round(v, 3) for r, v in nll.items() if r in RULES and v is not None}


def run_lock(cfg: RunConfig) -> Path:
    """The lock a run's flow holds while it learns: one stream per run at a time (the daily run
    waits for a backfill), whatever the memory's own lock allows between days."""
    return workdirs.run_lock(cfg.workdir, cfg.name)


def recorded_days(cfg: RunConfig) -> dict[str, dict]:
    """The evaluated days of this run (date -> its row), from earlier flow runs too."""
    return workdirs.read_rows(cfg.workdir, cfg.name)


@task(cache_policy=NO_CACHE)
def record_day(cfg: RunConfig, row: dict) -> None:
    """Record a finished day's row in the memory's manifest and the run's record (atomically); the
    stream resumes after it."""
    run_for(cfg).record(row)
