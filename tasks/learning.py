"""Tasks of one streaming day: ingest, memorize, update the index, calibrate, evaluate."""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from monim.config import BARE, RunConfig
from monim.datastore import _write_json
from monim.evaluate import evaluate as evaluate_docs
from monim.lm import LM, load_lm
from monim.calibration import calibrate as calibrate_memory
from monim.memory import Memory, memorize_day
from monim.stream import Day, read_day


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, a plain logger outside (e.g. unit tests via .fn)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("monim")


@functools.lru_cache(maxsize=2)
def lm_for(model: str | None) -> LM:
    """The LM, loaded once per process (flows run many days in one process)."""
    return load_lm(model)


def memory_for(cfg: RunConfig) -> Memory:
    return Memory(cfg.memory_dir, lm_for(cfg.model), cfg.index_config(), cfg.calibrator_config(), cfg.calibrated)


def day_of(cfg: RunConfig, date: str) -> Day:
    day = read_day(cfg.source, dt.date.fromisoformat(date), cfg.seed)
    if day is None:
        raise ValueError(f"{cfg.source} has no articles on {date}")
    return day


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def ingest(config: dict, date: str) -> dict:
    """Read the day's news slice and report its split sizes."""
    day = day_of(RunConfig(**config), date)
    counts = {"train": len(day.train), "validation": len(day.validation), "test": len(day.test),
              "skipped": day.skipped, "duplicates": day.duplicates, "twin_groups": day.twin_groups}
    logger().info("%s: %s", date, counts)
    return counts


@task(retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def memorize(config: dict, date: str) -> dict:
    """Score the day with Θ, memorize through the policy, commit atomically (idempotent)."""
    cfg = RunConfig(**config)
    memory, day = memory_for(cfg), day_of(cfg, date)
    artifact = create_progress_artifact(0.0, description=f"{cfg.name}: memorizing {date}")
    stats = memorize_day(memory, day, cfg.make_policy(), cfg.score_config(), cfg.max_docs, cfg.seed,
                         progress=lambda done, total: update_progress_artifact(artifact, 100.0 * done / max(total, 1)))
    update_progress_artifact(artifact, 100.0)
    if stats.committed:
        logger().info("%s %s: stored %d of %d tokens (MemRate %.1f%%)", cfg.name, date, stats.stored,
                      stats.tokens_seen, 100 * stats.memrate)
    else:
        logger().info("%s %s: already in memory, nothing changed", cfg.name, date)
    return stats.as_dict() | {"entries": len(memory), "bytes": memory.bytes_on_disk(), "memrate_total": memory.ds.memrate}


@task(retries=1, cache_policy=NO_CACHE)
def update_index(config: dict) -> dict:
    """Bring the FAISS index up to the committed memory (a stale or missing index is rebuilt)."""
    stats = memory_for(RunConfig(**config)).sync()
    logger().info("index: %s", stats)
    return stats


@task(retries=1, cache_policy=NO_CACHE)
def calibrate(config: dict, date: str) -> dict:
    """Add the day's calibration examples, tune the constant λ, T and train the NN calibrator
    (idempotent per day); say so when tomorrow's Θ falls back to the LM alone."""
    cfg = RunConfig(**config)
    memory = memory_for(cfg)
    record = calibrate_memory(memory, day_of(cfg, date), cfg.score_config())
    interp = memory.interpolation  # just tuned, or as it stood if the day was already calibrated
    out = {"lam": interp.lam, "temperature": interp.temperature, "theta": memory.ds.manifest["theta"].get("dir", ""),
           "theta_fallback": int(memory.fallback)}
    if record.get("trained"):
        nll = record["nll"]
        out |= {"calibration_tokens": record["calibration_tokens"], "calibration_new_tokens": record["new_tokens"],
                "heldout_nll_lm": nll["lm"], "heldout_nll_constant": nll["constant"],
                "heldout_nll_calibrator": nll["calibrator"], "calibrator_seconds": record["calibrator"]["seconds"]}
        logger().info("calibrated on %d tokens (%s): constant λ=%.2f T=%g; held-out NLL: LM %.3f, constant λ %.3f, "
                      "calibrator %.3f", record["calibration_tokens"], record["source"], record["lam"],
                      record["temperature"], nll["lm"], nll["constant"], nll["calibrator"])
    if memory.fallback:
        logger().warning("%s %s: Θ is worse than the LM on %d held-out tokens: tomorrow's Θ falls back to the LM alone",
                         cfg.name, date, memory.theta()["nll"]["tokens"])
    return out


def _evaluation_key(context, parameters: dict) -> str:
    """Cache key: the day, the run's settings and the memory's state, never tensors."""
    cfg = RunConfig(**parameters["config"])
    return f"monim-eval-{cfg.fingerprint()}-{parameters['date']}-{parameters['memory_state']}"


@task(cache_key_fn=_evaluation_key, persist_result=True)
def evaluate(config: dict, date: str, memory_state: str) -> dict:
    """Test PPL and next-word accuracy, bare LM and LM + memory, on the day's test articles."""
    cfg = RunConfig(**config)
    memory = None if cfg.policy == BARE else memory_for(cfg)
    metrics = evaluate_docs(lm_for(cfg.model), day_of(cfg, date).test, memory, cfg.score_config())
    logger().info("%s %s: test PPL %.2f (LM alone %.2f), accuracy %.3f", cfg.name, date, metrics["ppl"],
                  metrics["ppl_lm"], metrics["accuracy"])
    return metrics


def record_path(cfg: RunConfig) -> Path:
    return Path(cfg.workdir) / "runs" / f"{cfg.name}.json"


def recorded_days(config: dict) -> dict[str, dict]:
    """The finished days of this run (date -> its row), from earlier flow runs too."""
    path = record_path(RunConfig(**config))
    return json.loads(path.read_text()) if path.exists() else {}


@task(cache_policy=NO_CACHE)
def record_day(config: dict, row: dict) -> None:
    """Add a finished day's row to the run's record (atomically); the stream resumes after it."""
    path = record_path(RunConfig(**config))
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, recorded_days(config) | {row["date"]: row})
