"""A day's LM pass on a Dask cluster: its articles split across the workers, each running the LM
(loaded once per worker process) and writing its part of the feature store. After it, the memory's
searches run on the workers too (tasks.cluster); the commit stays in the flow's process: one writer
per memory."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from monim.core.run_config import RunConfig
from monim.data.day import Day
from monim.lm.features import balanced_parts
from monim.run import Run
from tasks.learning import featurize, featurize_part
from tasks.logs import logger

PARTS_PER_THREAD = 2  # a little slack for uneven articles and workers


def threads(address: str) -> int:
    """How many threads the workers of the cluster at `address` run in all now (each shares its process's LM)."""
    from distributed import Client

    with Client(address, timeout=60) as client:
        return sum(w["nthreads"] for w in client.scheduler_info()["workers"].values())


@flow(name="monim-featurize-cluster")
def featurize_on_cluster(cfg: RunConfig, day: Day, splits: tuple[str, ...]) -> dict:
    """Run the LM over the day's articles on the cluster's workers, into the work directory's feature store."""
    started = time.perf_counter()
    cfg = cfg.model_copy(update={"workdir": str(Path(cfg.workdir).resolve())})  # the workers' cwd is not ours
    if not cfg.cluster:
        raise ValueError("featurize_on_cluster needs the run's cluster (its settings name none)")
    n = PARTS_PER_THREAD * threads(cfg.cluster)
    futures = [featurize_part.submit(cfg, part, f"{day.date}-{split}-p{i}")
               for split in splits for i, part in enumerate(balanced_parts(day.split(split), n))]
    parts = [f.result() for f in futures]
    tokens, seconds = sum(p["tokens"] for p in parts), time.perf_counter() - started
    used = sorted({p["worker"] for p in parts if p["tokens"]})
    if tokens:
        logger().info("%s: %d workers ran the LM over %d tokens in %.0f s (%.0f tokens/s)", day.date, len(used),
                      tokens, seconds, tokens / seconds)
    return {"tokens": tokens, "seconds": seconds, "workers": len(used)}


def featurize_day(run: Run, day: Day) -> dict:
    """The day's LM pass over the run's splits: on its cluster's workers when its settings name one, else in this process."""
    if not run.cfg.cluster:
        return featurize(run, day)
    from prefect_dask import DaskTaskRunner  # only with a cluster: dask.distributed takes a while to import

    runner = DaskTaskRunner(address=run.cfg.cluster)
    return featurize_on_cluster.with_options(task_runner=runner)(run.cfg, day, run.splits)  # type: ignore[arg-type]
