"""A day's searches on a Dask cluster as the memory grows: measured per worker count and size, projected to a year.

A synthetic memory of SmolLM2-135M's shape (576-dim keys clustered and drifting by day, as
`monim bench index-scale` makes them) is committed day by day through monim's own Datastore and
index sync, the one writer's work (commit and sync timed per day). At each measured size a day's
searches run through the product's path, `Memory.nearest` after `Memory.spread_over(workers)`: in
this process, then on a `distributed.LocalCluster` of 1 and 2 worker processes of one thread each
(the library's Workers on a Dask client), with the memory as one index and split in parts
(`--part-bytes`: a second memory of the same days): MoNIM's decision searches (k = k_decide = 128)
and the evaluation's (k = 1,024), in calls of 1,024 queries as a day asks them and in calls of
8,192. At the largest size, in this process, nprobe 32..512 gives the cost of a query against the
codes it scans, and both memories' answers are checked against an exact scan (recall). Every row is saved as it comes (a rerun resumes from the result JSON and the work
folder). From the rows, a stated model of a day's wall time against memory size and workers,
projected to NC-20H1's six months (220M entries) and a year (440M).
Usage: monim bench cluster-scale [--sizes 100000,300000,600000,1000000] [--workers 0,1,2] [--part-bytes 21600000]
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks.harness import WORK, parser, resume, save
from benchmarks.index_scale import Keys
import faiss
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.storage.entries import Entries

STAGES = {"decision": 128, "evaluation": 1024}  # k of each stage's searches (IndexConfig.k_decide, .k)
# how a day asks its searches: (queries a call, calls at once): one call of 1,024 at a time, as memorize and
# evaluate do now; calls of 8,192 (two query batches of 4,096, one a worker); two calls of 1,024 at once (threads)
CALLS = ((1024, 1), (8192, 1), (1024, 2))
NPROBES = (32, 128, 512)
# a day of NC-20H1 as the model reads it (docs/results/gpu.md's paper-sized day; CalibratorConfig.sample_tokens)
DAY = {"train_tokens": 2_400_000, "decision_share": 0.7, "calibration_queries": 16_384, "test_tokens": 240_000,
       "entries_per_day": 220_000_000 / 182}
LM_TOK_S_CORE = 640 * 0.63 / 2  # SmolLM2-135M's body on 2 cores, the LM pass at 0.63x of it (docs/results/pipeline.md)
CALIBRATOR_S = 7.0  # the calibrator's training on 2 cores, FullMem on a Reuters day (docs/results/pipeline.md)
GOALS = {"an hour": 3600, "ten minutes": 600}
PART_GB = 4.0  # the "parts, calls at once" layout: a worker's budget of index (part_bytes), GB
LAYOUTS = ("replicated", "parts", "parts, calls at once")


class DaskWorkers:
    """The library's Workers on a Dask client (tasks/cluster.py's, less the Prefect task per part): each item a
    Dask task, the results gathered in the items' order."""

    def __init__(self, client):
        self.client, self.size = client, sum(client.nthreads().values())

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return self.client.gather(self.client.map(fn, items, pure=False))


@contextmanager
def cluster(n: int) -> Iterator[DaskWorkers | None]:
    """Workers on a LocalCluster of n processes of one thread each (None for 0: this process)."""
    if not n:
        yield None
        return
    from distributed import Client, LocalCluster

    with (LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                       env={"OMP_NUM_THREADS": "1"}) as local, Client(local) as client):
        yield DaskWorkers(client)


def grow(memory, keys: Keys, size: int, day: int, days: list[dict]) -> None:
    """Commit synthetic days of `day` keys until the memory holds `size` entries, syncing its index after
    each as memorize_day does; each day's costs appended to `days`."""
    while len(memory.ds) < size:
        t, n = len(memory.ds.days), min(day, size - len(memory.ds))
        x = keys.day(t, n, seed=1000 + t).astype(np.float16)
        started = time.perf_counter()
        memory.ds.commits.commit_day(f"2000-{1 + t // 28:02d}-{1 + t % 28:02d}",
                                     Entries(x, np.zeros(n, np.int32), [f"t{t}"] * n, np.arange(n)), n, "fullmem")
        commit_s = time.perf_counter() - started
        stats = memory.sync()
        days.append({"day": t, "entries": len(memory.ds), "commit_s": commit_s, "sync_s": stats["seconds"],
                     "rebuilt": bool(stats["rebuilt"]), "added": int(stats["added"]),
                     "nlist": memory.index.meta.get("nlist", 0), "kind": memory.index.meta.get("kind"),
                     "parts": len(memory.parts.plan(memory.ds))})
        print(json.dumps(days[-1]), flush=True)


def timed(memory, queries: np.ndarray, k: int, call: int, at_once: int = 1, repeat: int = 2) -> float:
    """Seconds to search every query for its k nearest, in calls of `call` queries, `at_once` calls at a time:
    the fastest of `repeat` runs (the machine is shared)."""
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        with ThreadPoolExecutor(at_once) as pool:
            list(pool.map(lambda i: memory.nearest(queries[i : i + call], k), range(0, len(queries), call)))
        runs.append(time.perf_counter() - started)
    return min(runs)


def measure(memory, queries: np.ndarray, workers: list[int], parts: int, base: dict, rows: list[dict], flush) -> None:
    """A day's searches (every stage, every call size) per worker count, rows appended (those done skipped)."""
    done = {(r["entries"], r["parts"], r["workers"], r["stage"], r["call"], r["at_once"]) for r in rows if "nprobe" not in r}
    for n in workers:
        todo = [(s, k, c, a) for s, k in STAGES.items() for c, a in CALLS
                if a <= max(n, 1) and (base["entries"], parts, n, s, c, a) not in done]
        if not todo:
            continue
        with cluster(n) as w:
            memory.spread_over(w)
            started = time.perf_counter()
            for _ in range(2):  # every worker opens the memory (a call of 8,192 asks two)
                memory.nearest(queries[:8192], STAGES["evaluation"])
            first_s = time.perf_counter() - started
            for stage, k, call, at_once in todo:
                seconds = timed(memory, queries, k, call, at_once)
                rows.append(base | {"parts": parts, "workers": n, "stage": stage, "k": k, "call": call, "at_once": at_once,
                                    "queries": len(queries), "seconds": seconds, "queries_per_s": len(queries) / seconds,
                                    "open_s": first_s, "load": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
                flush()
            memory.spread_over(None)


def sweep(root: Path, lm, queries: np.ndarray, base: dict, rows: list[dict], flush) -> None:
    """In this process, nprobe 32..512 (a reader's setting): a query's cost against the codes it scans."""
    from monim.theta.memory import Memory

    done = {(r["nprobe"], r["stage"]) for r in rows if r.get("nprobe") and r["entries"] == base["entries"]}
    for nprobe in NPROBES:
        memory = Memory.open(root, lm, nprobe=nprobe)
        for stage, k in STAGES.items():
            if (nprobe, stage) in done:
                continue
            seconds = timed(memory, queries, k, 1024)
            rows.append(base | {"parts": 1, "workers": 0, "nprobe": nprobe, "stage": stage, "k": k, "call": 1024, "at_once": 1,
                                "queries": len(queries), "seconds": seconds, "queries_per_s": len(queries) / seconds,
                                "load": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), flush=True)
            flush()


def recall(memories: list, queries: np.ndarray, result: dict, flush) -> None:
    """Each memory's answers (one index; parts) against an exact scan of every key, per stage: the share of
    the true k nearest found (recall@k) and of the true 10 nearest found in the k."""
    from benchmarks.index_scale import exact_search

    for stage, k in STAGES.items():
        if any(r["stage"] == stage for r in result["recall"]):
            continue
        _, truth = exact_search(memories[0][0].ds, queries, k)
        for memory, _ in memories:
            found = memory.nearest(queries, k)[1]
            hits = [np.isin(t, f) for t, f in zip(truth, found)]
            result["recall"].append({"entries": len(memory.ds), "parts": max(1, len(memory.parts.plan(memory.ds))),
                                     "stage": stage, "k": k, "queries": len(queries),
                                     "recall_at_k": float(np.mean([h.mean() for h in hits])),
                                     "top10_in_k": float(np.mean([h[:10].mean() for h in hits]))})
            print(json.dumps(result["recall"][-1]), flush=True)
            flush()


def codes(entries: float, nlist: float, nprobe: int = 32) -> float:
    """Codes a query scans: nprobe lists of the mean length."""
    return nprobe * entries / nlist


def nlist_at(entries: float, cap: int = 4096) -> int:
    """The lists the index has at this size (monim.storage.index.scaled_nlist's rule)."""
    from monim.storage.index import scaled_nlist

    return scaled_nlist(int(entries), cap)


def merged(result: dict, flush) -> None:
    """The flow's merge of the parts' answers (monim.storage.parts.merge), per query, by parts and k."""
    from monim.storage.parts import merge

    rng = np.random.default_rng(0)
    for k in STAGES.values():
        for parts in (2, 8, 32):
            if any(m["parts"] == parts and m["k"] == k for m in result["merge"]):
                continue
            found = [(np.sort(rng.random((1024, k), np.float32), 1), rng.integers(0, 1 << 40, (1024, k))) for _ in range(parts)]
            started = time.perf_counter()
            merge(found, k)
            result["merge"].append({"parts": parts, "k": k, "seconds_per_query": (time.perf_counter() - started) / 1024})
            flush()


def model(result: dict) -> dict:
    """A day's wall time against memory size N and workers W (one thread each), from the rows. A query's seconds
    on one thread: a + b x codes scanned (least squares per stage over this process's rows; codes = nprobe x
    entries / lists). Two layouts: "replicated", every worker holds the whole index and W calls run at once
    (at the speed-up measured for two calls at once on 2 workers); "parts", the memory split in W parts, one a
    worker, one call at a time (as the day asks now): a query waits for a part of N/W entries, then the flow
    merges W answers (m x W a query, measured); "parts, calls at once", the memory in parts of PART_GB of index
    and W calls at once: the parts' work divides over the workers, the flow merges every query's answers. Beside the searches: the LM's pass over the W workers and, on
    the flow's one process, the commit, the index's adds and the calibrator's training. Past 2 workers the
    work is assumed to divide evenly (each worker a core of its own): the speed-ups measured at 2 are kept
    beside it, not used, as 2 workers on 2 shared cores measure the machine's load as much as the split."""
    rows = [r for r in result["rows"] if r["workers"] == 0 and r["parts"] == 1]
    fit = {}
    for stage in STAGES:
        mine = [r for r in rows if r["stage"] == stage]
        x = np.array([codes(r["entries"], r["nlist"], r.get("nprobe", 32)) for r in mine])
        y = np.array([r["seconds"] / r["queries"] for r in mine])
        (b, a), *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)
        fit[stage] = {"a_s": float(a), "b_s_per_code": float(b), "points": len(mine),
                      "max_rel_error": float(np.max(np.abs(a + b * x - y) / y))}
        m = [(r["parts"], r["seconds_per_query"]) for r in result["merge"] if r["k"] == STAGES[stage]]
        fit[stage]["merge_s_per_part"] = float(np.polyfit(*zip(*m), 1)[0])
    largest = max(r["entries"] for r in result["rows"] if r["parts"] == 1 and r["workers"])
    spread = {}
    for stage in STAGES:
        at = {(r["workers"], r["call"], r["at_once"]): r["seconds"] / r["queries"] for r in result["rows"]
              if r["entries"] == largest and r["parts"] == 1 and r["stage"] == stage and "nprobe" not in r}
        spread[stage] = {"speedup_2_calls_of_1024": at[(1, 1024, 1)] / at[(2, 1024, 1)],
                         "speedup_2_two_calls_at_once": at[(1, 1024, 1)] / at[(2, 1024, 2)],
                         "speedup_2_calls_of_8192": at[(1, 1024, 1)] / at[(2, 8192, 1)],
                         "dask_s_per_call": max(0.0, (at[(1, 1024, 1)] - at[(0, 1024, 1)]) * 1024)}
    steady = [d for d in result["days"] if not d["rebuilt"] and d["added"]]
    add_rate = float(np.median([d["added"] / d["sync_s"] for d in steady[-3:]]))
    commit_rate = float(np.median([d["added"] / d["commit_s"] for d in steady[-3:]]))
    per_day = DAY["entries_per_day"]
    queries = {"decision": DAY["train_tokens"] * DAY["decision_share"],
               "evaluation": DAY["calibration_queries"] + DAY["test_tokens"]}  # calibration searches at k = 1,024 too

    def day(entries: float, workers: int, layout: str) -> dict:
        lm = (DAY["train_tokens"] + DAY["test_tokens"]) / (LM_TOK_S_CORE * workers)
        search = {}
        for s, f in fit.items():
            calls = queries[s] / 1024 * spread[s]["dask_s_per_call"] * (workers > 1)
            if layout == "replicated":
                per_query = (f["a_s"] + f["b_s_per_code"] * codes(entries, nlist_at(entries))) / workers
                search[s] = queries[s] * per_query + calls / workers
            elif layout == "parts, calls at once":
                n_parts = max(1, math.ceil(entries * result["index_bytes_per_entry"] / (PART_GB * 1e9)))
                part = entries / n_parts
                work = n_parts * (f["a_s"] + f["b_s_per_code"] * codes(part, nlist_at(part)))
                merge = f["merge_s_per_part"] * n_parts * (n_parts > 1)
                search[s] = queries[s] * (work / workers + merge) + calls * n_parts / workers
            else:
                part = entries / workers
                merge = f["merge_s_per_part"] * workers * (workers > 1)
                search[s] = queries[s] * (f["a_s"] + f["b_s_per_code"] * codes(part, nlist_at(part)) + merge) + calls
        one = per_day / commit_rate + per_day / add_rate + CALIBRATOR_S
        return {"lm_s": lm, **{f"{s}_s": v for s, v in search.items()}, "one_process_s": one,
                "wall_s": lm + sum(search.values()) + one}

    sizes = {"measured": largest, "six months (NC-20H1)": 220e6, "a year": 440e6}
    projection = {}
    for name, n in sizes.items():
        p = {"entries": n, "nlist": nlist_at(n), "codes_per_query": codes(n, nlist_at(n)),
             "index_gb": n * result["index_bytes_per_entry"] / 1e9, "one_core": day(n, 1, "replicated")}
        for layout in LAYOUTS:
            walls = {w: day(n, w, layout) for w in range(1, 4097)}
            needed = {g: next((w for w, d in walls.items() if d["wall_s"] <= s), None) for g, s in GOALS.items()}
            best = min(walls, key=lambda w: walls[w]["wall_s"])
            p[layout] = {"workers_for": needed, "at": {g: walls[w] for g, w in needed.items() if w},
                         "fastest": {"workers": best, **walls[best]}}
        projection[name] = p
    return {"fit": fit, "spread": spread, "add_keys_per_s": add_rate,
            "commit_keys_per_s": commit_rate, "retrain_readd_hours": {name: n / add_rate / 3600 for name, n in sizes.items()},
            "day": DAY, "lm_tok_s_core": LM_TOK_S_CORE, "calibrator_s": CALIBRATOR_S, "projection": projection}


def report(result: dict) -> None:
    """The measured rows and the projection as tables."""
    table = Table(title="A day's searches, queries/s (one thread a worker)")
    for col in ("entries", "lists", "parts", "workers", "stage (k)", "call x at once", "queries/s"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        if "nprobe" not in r:
            table.add_row(f"{r['entries']:,}", str(r["nlist"]), str(r["parts"]), str(r["workers"] or "this process"),
                          f"{r['stage']} ({r['k']})", f"{r['call']:,} x {r['at_once']}", f"{r['queries_per_s']:,.0f}")
    Console(width=170).print(table)
    table = Table(title="A day of NC-20H1 (projected past the measured size): workers (one core each) for a day under")
    for col in ("memory", "entries", "index GB", "one core: day h", *(f"{g}, {lay}" for g in GOALS for lay in LAYOUTS)):
        table.add_column(col, justify="right")
    for name, p in result["model"]["projection"].items():
        table.add_row(name, f"{p['entries']:,.0f}", f"{p['index_gb']:.1f}", f"{p['one_core']['wall_s'] / 3600:.1f}",
                      *(str(p[lay]["workers_for"][g] or "none") for g in GOALS for lay in LAYOUTS))
    Console(width=170).print(table)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "cluster-scale")
    ap.add_argument("--sizes", default="100000,300000,600000,1000000", help="memory sizes measured (entries)")
    ap.add_argument("--day", type=int, default=100_000, help="keys committed per synthetic day")
    ap.add_argument("--workers", default="0,1,2", help="LocalCluster worker counts (0: this process)")
    ap.add_argument("--part-bytes", type=int, default=21_600_000, help="the split memory's part_bytes (21.6 MB: 300k IVF-PQ entries of 72 bytes, 3 days a part; 0: none)")
    ap.add_argument("--queries", type=int, default=4096, help="queries per stage and setting (a day's, scaled down)")
    ap.add_argument("--minutes", type=float, default=25, help="stop before a size past this many minutes (rerun resumes)")
    ap.add_argument("--work", type=Path, default=WORK / "cluster-scale")
    ap.add_argument("--model", action="store_true", help="print the tables and the model from the result JSON (nothing run)")
    args = ap.parse_args(argv)
    if args.model:
        result = resume(args.out, {})
        return report(result | {"model": model(result)})
    os.environ["OMP_NUM_THREADS"] = "1"  # this process and every worker: one thread each
    faiss.omp_set_num_threads(1)
    from monim.core.config import IndexConfig
    from monim.lm.model import cached_lm
    from monim.storage.memory_settings import Settings
    from monim.theta.memory import Memory

    started = time.perf_counter()
    result = resume(args.out, {"days": [], "split_days": [], "rows": [], "merge": []})
    lm = cached_lm()
    memories = [(Memory(args.work / "memory", lm, Settings()), result["days"])]
    if args.part_bytes:
        split = Memory(args.work / "split", lm, Settings(index=IndexConfig(part_bytes=args.part_bytes)))
        memories.append((split, result["split_days"]))
    for memory, days in memories:
        if len(memory.ds) != (days[-1]["entries"] if days else 0):
            raise SystemExit(f"{memory.ds.root} does not hold the days {args.out} recorded: remove both to start again")
    keys, workers = Keys(), [int(w) for w in args.workers.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    flush = lambda: save(args.out, result, args)  # noqa: E731
    for size in sizes:
        if time.perf_counter() - started > args.minutes * 60:
            print(f"stopped before {size:,} entries: past {args.minutes} minutes (rerun to resume)")
            break
        queries = keys.day(size // args.day, args.queries, seed=7)  # tomorrow's keys look like today's
        for memory, days in memories:
            if len(memory.ds) > size:  # measured before (a resumed run)
                continue
            grow(memory, keys, size, args.day, days)
            flush()
            plan = memory.parts.plan(memory.ds)
            split = len(plan) > 1
            nlist = [memory.parts.index(p).meta.get("nlist", 0) for p in plan] if split else memory.index.meta.get("nlist", 0)
            measure(memory, queries, workers, len(plan) if split else 1, {"entries": size, "nlist": nlist},
                    result["rows"], flush)
    whole = memories[0][0]
    result["index_bytes_per_entry"] = whole.index.bytes_on_disk() / len(whole.ds)
    sweep(whole.ds.root, lm, queries[: args.queries // 4], {"entries": len(whole.ds), "nlist": whole.index.meta.get("nlist", 0)},
          result["rows"], flush)
    merged(result, flush)
    result.setdefault("recall", [])
    recall([(m, d) for m, d in memories if len(m.ds) == len(whole.ds)], queries[: args.queries // 4], result, flush)
    result["model"] = model(result)
    save(args.out, result, args)
    report(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
