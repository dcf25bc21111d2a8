"""Tasks of one streaming day: ingest, memorize, update the index, calibrate, evaluate; or, for a
parametric learner, train the weights."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import socket
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

from monim.config import RunConfig
from monim.evaluate import evaluate as evaluate_docs
from monim.lm import LM, load_lm
from monim.calibration import calibrate as calibrate_memory
from monim.memory import Memory, memorize_day
from monim.parametric import Weights, load_day, train_day, trained_copy
from monim import records
from monim.stream import SPLITS, Day, Document, read_day
from monim.features import Features
from monim.scoring import ScoreConfig


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, a plain logger outside (e.g. unit tests via .fn)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("monim")


@functools.lru_cache(maxsize=2)
def lm_for(model: str | None, dtype: str = "auto") -> LM:
    """The LM, loaded once per process (flows run many days in one process)."""
    return load_lm(model, dtype)


@functools.lru_cache(maxsize=1)
def _trainable(model: str | None, dtype: str) -> LM:
    """The one copy of the LM whose weights a parametric learner trains or a day's weights are loaded into."""
    return trained_copy(lm_for(model, dtype))


_LOADED: dict[int, tuple[str, str | None]] = {}  # id(LM) -> (weights folder, day) it holds


def lm_at(cfg: RunConfig, date: str | None) -> LM:
    """The LM of a parametric run as its weights stood after `date` (None, or before its first day:
    the pretrained weights), loaded into the process's trainable copy when it holds other weights."""
    lm = _trainable(cfg.model, cfg.dtype)
    weights = Weights(cfg.weights_dir)
    day = None if date is None else weights.as_of(date)
    if _LOADED.get(id(lm)) != (str(weights.root), day):
        _LOADED.pop(id(lm), None)
        load_day(lm, weights, day, lm_for(cfg.model, cfg.dtype))
        _LOADED[id(lm)] = (str(weights.root), day)
    return lm


def scorer(cfg: RunConfig, date: str | None) -> tuple[LM, Features | ScoreConfig]:
    """What run `cfg` predicts with as of `date`, and how to score with it: the frozen LM through the
    feature store, or a parametric learner's weights of that day (scored live: nothing to share)."""
    if cfg.parametric:
        return lm_at(cfg, date), cfg.score_config()
    return lm_for(cfg.model, cfg.dtype), features_for(cfg)


def memory_for(cfg: RunConfig) -> Memory:
    return Memory(cfg.memory_dir, lm_for(cfg.model, cfg.dtype), cfg.index_config(), cfg.calibrator_config(), cfg.calibrated)


_FEATURES: dict[tuple, Features] = {}


def features_for(cfg: RunConfig) -> Features:
    """The run's feature store (one object per process: it remembers what the store holds)."""
    f = cfg.features(lm_for(cfg.model, cfg.dtype))
    return _FEATURES.setdefault((cfg.model, f.lm.dtype, astuple(f.cfg), f.store, f.max_bytes), f)


@contextmanager
def progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A stage's progress as (tokens done, tokens in all): a terminal bar with tokens/s, and a
    Prefect progress artifact."""
    artifact = create_progress_artifact(0.0, description=description)
    bar = tqdm(desc=description, unit="tok", unit_scale=True, mininterval=1.0, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        update_progress_artifact(artifact, 100.0 * done / max(total, 1))

    try:
        yield update
    finally:
        bar.close()
        update_progress_artifact(artifact, 100.0)


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def ingest(cfg: RunConfig, date: str) -> Day:
    """Read the day's news slice (once: the other tasks are handed it) and report its split sizes."""
    day = read_day(cfg.source, dt.date.fromisoformat(date), cfg.seed)
    if day is None:
        raise ValueError(f"{cfg.source} has no articles on {date}")
    logger().info("%s: %s", date, day.counts())
    return day


def featurized(cfg: RunConfig, day: Day) -> dict[str, list[Document]]:
    """The articles of a day the LM runs over, by split (the training articles the run takes). A run
    without a memory (the bare LM, a learner) needs the frozen LM on the test articles only."""
    splits = SPLITS if cfg.has_memory else ("test",)
    return {split: day.train[: cfg.max_docs] if split == "train" else day.split(split) for split in splits}


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def featurize(cfg: RunConfig, day: Day) -> dict:
    """Run the LM over the day's articles the feature store lacks (every split; no-op without a store)."""
    features = features_for(cfg)
    started, tokens = time.perf_counter(), 0
    for split, docs in featurized(cfg, day).items():
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
        stats = memorize_day(memory, day, cfg.make_policy(), features_for(cfg), cfg.max_docs, cfg.seed, progress=update)
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
    pretrained = lm_for(cfg.model, cfg.dtype).model.state_dict() if learner.method == "recadam" else None
    step = weights.meta(previous)["step"] if previous else 0
    _LOADED.pop(id(lm), None)  # its weights change now: reloaded at the next lm_at if training fails
    stats = train_day(lm, day.train[: cfg.max_docs], learner, index, step, pretrained)
    weights.save(date, lm.model, stats | {"date": date, "from": previous})
    _LOADED[id(lm)] = (str(weights.root), date)
    logger().info("%s %s: trained on %d tokens (+%d review) in %d steps, loss %.3f, %.0f s", cfg.name, date,
                  stats["tokens_trained"], stats["review_tokens"], stats["steps"], stats["train_loss"], stats["seconds_train"])
    return weights.meta(date)


@task(retries=1, cache_policy=NO_CACHE)
def update_index(memory: Memory) -> dict:
    """Bring the FAISS index up to the committed memory (a stale or missing index is rebuilt)."""
    stats = memory.sync()
    logger().info("index: %s", stats)
    return stats


@task(retries=1, cache_policy=NO_CACHE)
def calibrate(cfg: RunConfig, day: Day, memory: Memory) -> dict:
    """Add the day's calibration examples, tune the constant λ, T and train the NN calibrator
    (idempotent per day); say so when tomorrow's Θ falls back to the LM alone."""
    record = calibrate_memory(memory, day, features_for(cfg))
    interp = memory.interpolation  # just tuned, or as it stood if the day was already calibrated
    out = {"lam": interp.lam, "temperature": interp.temperature, "theta": memory.ds.theta_at().get("dir", ""),
           "theta_fallback": int(memory.fallback)}
    if "nll" in record:  # trained now, or as the day's calibration recorded it
        nll = record["nll"]
        out |= {"calibration_tokens": record["calibration_tokens"], "calibration_new_tokens": record["new_tokens"],
                "heldout_nll_lm": nll["lm"], "heldout_nll_constant": nll["constant"],
                "heldout_nll_calibrator": nll["calibrator"], "calibrator_seconds": record["calibrator"]["seconds"]}
    if record["trained"]:
        logger().info("calibrated on %d tokens (%s): constant λ=%.2f T=%g; held-out NLL: LM %.3f, constant λ %.3f, "
                      "calibrator %.3f", record["calibration_tokens"], record["source"], record["lam"],
                      record["temperature"], nll["lm"], nll["constant"], nll["calibrator"])
    if memory.fallback:
        logger().warning("%s %s: Θ is worse than the LM on %d held-out tokens: tomorrow's Θ falls back to the LM alone",
                         cfg.name, day.date, memory.theta()["nll"]["tokens"])
    return out


def _evaluation_key(context, parameters: dict) -> str:
    """Cache key: the day, the run's settings (the LM's dtype as "auto" resolved it on this machine)
    and the memory's state, never tensors."""
    cfg = parameters["cfg"]
    dtype = lm_for(cfg.model, cfg.dtype).dtype
    return f"monim-eval-{cfg.fingerprint()}-{dtype}-{parameters['date']}-{parameters['memory_state']}"


@task(cache_key_fn=_evaluation_key, persist_result=True)
def evaluate(cfg: RunConfig, date: str, memory_state: str, day: Day, memory: Memory | None) -> dict:
    """Test PPL and next-word accuracy, bare LM and LM + memory (None: the bare LM), on the day's test articles."""
    started = time.perf_counter()
    metrics = evaluate_docs(lm_for(cfg.model, cfg.dtype), day.test, memory, features_for(cfg), f"{date}-test")
    if cfg.parametric:  # Θ is the day's weights; "LM alone" stays the pretrained LM's, as for every run
        lm, scoring = scorer(cfg, date)
        trained = evaluate_docs(lm, day.test, None, scoring, f"{date}-test")
        metrics |= {k: trained[k] for k in ("ppl", "accuracy", "ppl_novel")}
    logger().info("%s %s: test PPL %.2f (LM alone %.2f), accuracy %.3f", cfg.name, date, metrics["ppl"],
                  metrics["ppl_lm"], metrics["accuracy"])
    return metrics | {"evaluate_seconds": time.perf_counter() - started}


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
