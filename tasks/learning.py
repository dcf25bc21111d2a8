"""Tasks of one streaming day: ingest, featurize, memorize (and update the index), calibrate; or, for
a parametric learner, train the weights; and the run records a stream resumes from."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import astuple
from pathlib import Path
from typing import Callable, Iterator

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from tqdm.auto import tqdm

from monim import records
from monim.calibration import calibrate as calibrate_memory
from monim.config import RunConfig
from monim.features import Features
from monim.knnlm import RULES
from monim.lm import LM, cached_lm
from monim.memorize import memorize_day
from monim.memory import Memory
from monim.parametric import Weights, load_day, train_day, trained_copy
from monim.sources import Document
from monim.stream import Day, read_day


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, a plain logger outside (e.g. unit tests via .fn)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("monim")


@functools.lru_cache(maxsize=1)
def _trainable(model: str | None, dtype: str) -> LM:
    """The one copy of the LM whose weights a parametric learner trains or a day's weights are loaded into."""
    return trained_copy(cached_lm(model, dtype))


_LOADED: dict[int, tuple[str, str | None]] = {}  # id(LM) -> (weights folder, day) it holds


def lm_at(cfg: RunConfig, date: str | None) -> LM:
    """The LM of a parametric run as its weights stood after `date` (None, or before its first day:
    the pretrained weights), loaded into the process's trainable copy when it holds other weights."""
    lm = _trainable(cfg.model, cfg.dtype)
    weights = Weights(cfg.weights_dir)
    day = None if date is None else weights.as_of(date)
    if _LOADED.get(id(lm)) != (str(weights.root), day):
        _LOADED.pop(id(lm), None)
        load_day(lm, weights, day, cached_lm(cfg.model, cfg.dtype))
        _LOADED[id(lm)] = (str(weights.root), day)
    return lm


_FEATURES: dict[tuple, Features] = {}


def features_for(cfg: RunConfig) -> Features:
    """The run's feature store (one object per process: it remembers what the store holds)."""
    f = cfg.features(cached_lm(cfg.model, cfg.dtype))
    return _FEATURES.setdefault((cfg.model, f.lm.dtype, astuple(f.cfg), f.store, f.max_bytes), f)


_MEMORIES: dict[tuple, Memory] = {}


def memory_for(cfg: RunConfig) -> Memory:
    """The run's memory, opened once per process to learn into with the run's settings (a memory
    learned with other settings is refused, naming them)."""
    key = (str(cfg.memory_dir.resolve()), cfg.model, cfg.settings().as_dict().__repr__())
    if key not in _MEMORIES or not (cfg.memory_dir / "manifest.json").exists():
        _MEMORIES[key] = Memory(cfg.memory_dir, cached_lm(cfg.model, cfg.dtype), cfg.settings())
    return _MEMORIES[key]


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
def ingest(cfg: RunConfig, date: str) -> Day:
    """Read the day's news slice (once: the other tasks are handed it), its training articles capped
    at the run's `max_docs` (the one place the cap applies), and report its split sizes."""
    day = read_day(cfg.source, dt.date.fromisoformat(date), cfg.seed, cfg.on_error, cfg.fields())
    if day is None:
        raise ValueError(f"{cfg.source} has no articles on {date}")
    day = day.capped(cfg.max_docs).truncate(cfg.max_article_tokens, cached_lm(cfg.model, cfg.dtype).cut)
    logger().info("%s: %s", date, day.counts())
    return day


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize(cfg: RunConfig, day: Day, splits: tuple[str, ...]) -> dict:
    """Run the LM over the day's articles of these splits that the feature store lacks (no-op without a store)."""
    features = features_for(cfg)
    started, tokens = time.perf_counter(), 0
    for split, docs in ((s, day.split(s)) for s in splits):
        with progress(f"LM features {day.date} {split}") as update:
            tokens += features.prepare(docs, f"{day.date}-{split}", update)
    seconds = time.perf_counter() - started
    if tokens:
        logger().info("%s: the LM scored %d tokens in %.0f s (%.0f tokens/s)", day.date, tokens, seconds, tokens / seconds)
    return {"tokens": tokens, "seconds": seconds}


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize_part(cfg: RunConfig, docs: list[Document], name: str) -> dict:
    """On a cluster's worker: run the LM (loaded once per worker process) over one part of a day's
    articles into the shared feature store."""
    started = time.perf_counter()
    tokens = features_for(cfg).prepare(docs, name)
    return {"tokens": tokens, "seconds": time.perf_counter() - started, "worker": f"{socket.gethostname()}:{os.getpid()}"}


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def memorize(cfg: RunConfig, day: Day, memory: Memory) -> dict:
    """Score the day with Θ, memorize through the policy, commit atomically (idempotent)."""
    with progress(f"{cfg.name}: memorizing {day.date}") as update:
        stats = memorize_day(memory, day, cfg.make_policy(), features_for(cfg), cfg.seed, progress=update)
    if stats.committed:
        logger().info("%s %s: stored %d of %d tokens (MemRate %.1f%%); index: %s", cfg.name, day.date, stats.stored,
                      stats.tokens_seen, 100 * stats.memrate, stats.index)
    else:
        logger().info("%s %s: already in memory, nothing changed", cfg.name, day.date)
    # the index's health as a metric where its probe measured it (rebuilds, which depend on the process's history, are logged)
    recall = stats.index.get("recall")
    return stats.as_dict() | {"entries": len(memory), "bytes": memory.bytes_on_disk(), "memrate_total": memory.ds.memrate,
                              "index": {} if recall is None else {"index_recall": recall}}


@task(retries=1, cache_policy=NO_CACHE)
def train(cfg: RunConfig, day: Day, index: int) -> dict:
    """A parametric learner's day: train the previous day's weights on the day's training articles
    (the stream's `index`-th day, for Mix-Review's decay) and commit them (a trained day is kept as it is)."""
    weights, date = Weights(cfg.weights_dir), day.date.isoformat()
    if date in weights.days():
        logger().info("%s %s: already trained, nothing changed", cfg.name, date)
        return weights.meta(date)
    learner = cfg.learner()
    previous = weights.latest(before=date)
    lm = lm_at(cfg, previous)
    pretrained = cached_lm(cfg.model, cfg.dtype).model.state_dict() if learner.method == "recadam" else None
    step = weights.meta(previous)["step"] if previous else 0
    _LOADED.pop(id(lm), None)  # its weights change now: reloaded at the next lm_at if training fails
    stats = train_day(lm, day.train, learner, index, step, pretrained)
    weights.save(date, lm.model, stats | {"date": date, "from": previous})
    _LOADED[id(lm)] = (str(weights.root), date)
    logger().info("%s %s: trained on %d tokens (+%d review) in %d steps, loss %.3f, %.0f s", cfg.name, date,
                  stats["tokens_trained"], stats["review_tokens"], stats["steps"], stats["train_loss"], stats["seconds_train"])
    return weights.meta(date)


@task(retries=1, cache_policy=NO_CACHE)
def calibrate(cfg: RunConfig, day: Day, memory: Memory) -> dict:
    """Add the day's calibration examples, tune the constant λ, T and train the NN calibrator
    (idempotent per day); say so when tomorrow's Θ falls back to the LM alone."""
    record = calibrate_memory(memory, day, features_for(cfg))
    interp, rule = memory.interpolation, memory.rule  # just tuned, or as it stood if the day was already calibrated
    out = {"lam": interp.lam, "temperature": interp.temperature, "theta_fallback": int(rule == "lm"),
           "theta_rule": RULES.index(rule)}
    nll = record.get("nll")  # trained now, or as the day's calibration recorded it
    if nll:
        out |= {"calibration_tokens": record["calibration_tokens"], "calibration_new_tokens": record["new_tokens"],
                "calibrator_seconds": record["calibrator"]["seconds"], "lam_copy": record.get("lam_copy", interp.lam)}
        out |= {f"heldout_nll_{r}": nll[r] for r in RULES if nll.get(r) is not None}
        out |= {f"heldout_seen_nll_{r}": v for r, v in (nll.get("seen") or {}).items() if r in RULES and v is not None}
    if record["trained"]:
        logger().info("calibrated on %d tokens (%s): constant λ=%.2f T=%g, λ on copies %.2f; held-out NLL on new text: %s; "
                      "on held contexts: %s; Θ's rule: %s", record["calibration_tokens"], record["source"], record["lam"],
                      record["temperature"], record["lam_copy"], _rounded(nll), _rounded(nll.get("seen") or {}), rule)
    if rule == "lm":
        logger().warning("%s %s: Θ is worse than the LM on %d held-out tokens: tomorrow's Θ falls back to the LM alone",
                         cfg.name, day.date, memory.theta()["nll"]["tokens"])
    return out


def _rounded(nll: dict) -> dict:
    return {r: round(v, 3) for r, v in nll.items() if r in RULES and v is not None}


def run_lock(cfg: RunConfig) -> Path:
    """The lock a run's flow holds while it learns: one stream per run at a time (the daily run
    waits for a backfill), whatever the memory's own lock allows between days."""
    return records.run_lock(cfg.workdir, cfg.name)


def recorded_days(cfg: RunConfig) -> dict[str, dict]:
    """The evaluated days of this run (date -> its row), from earlier flow runs too."""
    return records.read_rows(cfg.workdir, cfg.name)


@task(cache_policy=NO_CACHE)
def record_day(cfg: RunConfig, row: dict, memory: Memory | None) -> None:
    """Record a finished day's row in the memory's manifest and the run's record (atomically); the
    stream resumes after it."""
    records.write_row(cfg.workdir, cfg.name, row, memory)
