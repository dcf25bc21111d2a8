"""A day's searches on a Dask cluster: the memory's searches (MoNIM's decisions, calibration's samples,
the evaluation's kNN scoring) split into parts that the cluster's workers run, their results gathered
in order. The commit stays in the flow's process: one writer per memory.

Each search (<= 1,024 queries, ~100 a stage on a day) is one Prefect task in the flow's process named
by its stage ("decision search", ...), its parts plain Dask tasks (the Dask dashboard groups them by
the same name). A Prefect task per part, run on the worker through prefect-dask's client, cost 230-270 ms
a search of 2 parts against ~12 ms for plain Dask tasks and 23-38 ms with the Prefect task here
(2 workers, one local Prefect server, 2 busy cores)."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator
from uuid import uuid4

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from monim.run import MemoryRun, Run

STAGE: ContextVar[str] = ContextVar("monim_search_stage", default="search")  # names the searches of a stage


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Name the searches run inside (e.g. "decision search") in the Prefect UI and the Dask dashboard."""
    token = STAGE.set(name)
    try:
        yield
    finally:
        STAGE.reset(token)


def _gather(client, fn: Callable[[Any], Any], items: list[Any], name: str, holders: list[str | None]) -> list[Any]:
    """fn on each item as a Dask task on the workers (keyed by the stage's name), results in order; an
    item goes to its holder where it names one, preferred, not required: when it is lost another worker
    opens its part."""
    prefix = name.replace(" ", "-")  # the Dask dashboard groups tasks by their key's prefix
    return client.gather([client.submit(fn, item, key=f"{prefix}-{uuid4().hex}", workers=worker,
                                        allow_other_workers=worker is not None) for item, worker in zip(items, holders)])


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="{name}")
def search(client, fn: Callable[[Any], Any], items: list[Any], name: str, holders: list[str | None]) -> list[Any]:
    """One search of a stage, its parts on the cluster's workers."""
    return _gather(client, fn, items, name, holders)


class DaskWorkers:
    """monim.core.workers.Workers on the Dask cluster at `address`, one client for all its searches."""

    def __init__(self, address: str):
        from distributed import Client  # dask.distributed takes a while to import

        self.client = Client(address, timeout=60, set_as_default=False)
        self.holder: dict[str, str] = {}  # a part of the memory -> the worker that searches it

    def holders(self, items: list[Any]) -> list[str | None]:
        """The worker each item goes to: a part of the memory (a SearchPart's `part`) to the same
        worker in every search, a new one (or one whose worker left) to the worker holding the fewest,
        so that each worker holds only its share of the parts; None (any worker) for the whole index."""
        workers = sorted(self.client.scheduler_info()["workers"])
        held = Counter(w for w in self.holder.values() if w in workers)
        for part in sorted({p for p in (getattr(item, "part", None) for item in items) if p is not None}):
            if workers and self.holder.get(part) not in workers:
                self.holder[part] = min(workers, key=lambda w: held[w])
                held[self.holder[part]] += 1
        return [self.holder.get(getattr(item, "part", None) or "") for item in items]

    @property
    def size(self) -> int:
        """Parts that run at once: the workers' threads in all."""
        return max(1, sum(w["nthreads"] for w in self.client.scheduler_info()["workers"].values()))

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """fn on each item on the workers, results in the items' order (a part that fails fails the map);
        a Prefect task of its own inside a task run (a stage of the day)."""
        holders = self.holders(items)
        if TaskRunContext.get() is None:  # outside Prefect (a bench, Run.day): no task run to report to
            return _gather(self.client, fn, items, STAGE.get(), holders)
        return search(self.client, fn, items, STAGE.get(), holders)

    def close(self) -> None:
        self.client.close()


@contextmanager
def searching_on_cluster(run: Run) -> Iterator[None]:
    """Inside, the run's memory (and every view of it) searches on its cluster's workers, one client
    for all of it; back to this process after, also when a stage fails. Nothing without a cluster."""
    if not (run.cfg.cluster and isinstance(run, MemoryRun)):
        yield
        return
    workers = DaskWorkers(run.cfg.cluster)
    try:
        run.spread_over(workers)
        yield
    finally:
        run.spread_over(None)
        workers.close()
