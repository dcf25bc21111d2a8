"""One streaming day: ingest → LM features → memorize → index update → calibrate → evaluate → register → log
(a parametric learner trains its weights where a memory policy memorizes)."""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from monim.config import BARE, RunConfig
from monim.parametric import Weights
from flows.cluster import featurize_day
from tasks.learning import calibrate, evaluate, ingest, memorize, memory_for, record_day, train, update_index
from tasks.registry import register_day
from tasks.tracking import log_day


def _run_name() -> str:
    params = flow_run.parameters
    return f"{RunConfig.model_validate(params['cfg']).name}-{params['date']}"


@flow(name="monim-day", flow_run_name=_run_name)
def learn_day(cfg: RunConfig, date: str, run_id: str | None = None, tracking_uri: str | None = None, step: int = 0) -> dict:
    """Learn one day of news into the run's memory, evaluate it, and log the day's metrics.

    The day is read once and the memory opened once; every task is handed both."""
    day = ingest(cfg, date)
    row = {"date": date, "policy": cfg.name, "step": step} | {f"docs_{k}": v for k, v in day.counts().items()}
    lm_pass = featurize_day(cfg, day)
    started = time.perf_counter()  # the day's cost beyond the LM's pass (one per token, shared by every policy)
    row |= {"tokens_featurized": lm_pass["tokens"], "seconds_featurize": lm_pass["seconds"],
            "featurize_workers": lm_pass.get("workers", 1)}
    memory, state = None, "v0"
    if cfg.parametric:
        trained = train(cfg, day, step)
        state = f"w-{date}"
        row |= {k: trained[k] for k in ("tokens_trained", "review_tokens", "steps", "train_loss")} | {
            "tokens_seen": trained["tokens_trained"], "memory_bytes": Weights(cfg.weights_dir).bytes_on_disk()}
    elif cfg.policy != BARE:
        memory = memory_for(cfg)
        stats = memorize(cfg, day, memory)
        index = update_index(memory)
        theta = calibrate(cfg, day, memory)
        seconds = stats.pop("seconds") | {"index_update": index["seconds"]}
        pass_seconds = seconds.get("lm_and_search", 0.0) + seconds.get("policy", 0.0)
        state = f"v{stats['version']}-{theta.pop('theta')}"
        row |= {
            "tokens_seen": stats["tokens_seen"], "entries_stored": stats["stored"], "memrate_day": stats["memrate"],
            "memrate": stats["memrate_total"], "entries": stats["entries"], "memory_bytes": stats["bytes"],
            "tokens_per_s": stats["tokens_seen"] / pass_seconds if pass_seconds else 0.0,
        } | stats["index"] | theta | {f"seconds_{k}": v for k, v in seconds.items()}
    row["seconds_learn"] = time.perf_counter() - started
    row |= evaluate(cfg, date, state, day, memory and memory.at(date))  # as of the day, even when re-run later
    if run_id and memory is not None:
        row |= register_day(cfg, day, memory.at(date), run_id, tracking_uri)
    if run_id:
        log_day(run_id, tracking_uri, step, {k: v for k, v in row.items() if k not in ("date", "policy")})
    record_day(cfg, row, memory)
    create_table_artifact([{"metric": k, "value": v} for k, v in row.items()], key=f"monim-{cfg.name}-day",
                          description=f"{cfg.name}, {date}")
    return row
