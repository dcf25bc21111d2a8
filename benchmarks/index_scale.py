"""The index at scale: millions of synthetic keys day by day, search speed, recall and size to 100M.

The index at scale: millions of synthetic keys of the default model's size, day by day, through
monim's own Datastore and MemoryIndex (exact below 200k entries, then IVF: training, incremental
adds, the recall probe, retraining at 4x growth), then search speed, recall and size, projected to
100M entries.

Keys are clustered like SmolLM2-135M's (576 dims; squared L2 to the nearest ~10, to the 1,024th
~40, as measured on real memories) and their topics drift: day t draws from a sliding window of
clusters. Recall is against an exact scan of every key in the same process (its speed is the
baseline of the search speed-up).
Usage: monim bench index-scale [--n 5000000] [--day 500000] [--codec pq|fastscan]
"""

import json
import resource
import shutil
import time
from pathlib import Path

from benchmarks.harness import WORK, parser, save
import faiss
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.storage.datastore import Datastore
from monim.storage.entries import Entries
from monim.storage.index import IndexConfig, MemoryIndex

D, CLUSTERS, WINDOW, SUBSPACE = 576, 20_000, 8_000, 64


class Keys:
    """Clustered keys: a center in a 64-dim subspace plus noise with a decaying spectrum."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        basis = rng.standard_normal((SUBSPACE, D)).astype(np.float32) / 8
        self.centers = (rng.standard_normal((CLUSTERS, SUBSPACE)).astype(np.float32) @ basis) * 0.2
        self.rotation = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
        self.spectrum = (1 / np.sqrt(np.arange(1, D + 1))).astype(np.float32)

    def day(self, t: int, n: int, seed: int) -> np.ndarray:
        """n keys of day t: its topics are the clusters t*1000 .. t*1000+8000 (mod 20,000)."""
        rng = np.random.default_rng(seed)
        which = (t * 1000 + rng.integers(0, WINDOW, n)) % CLUSTERS
        noise = rng.standard_normal((n, D), dtype=np.float32) * self.spectrum
        return self.centers[which] + noise @ self.rotation


def exact_search(ds: Datastore, queries: np.ndarray, k: int, chunk: int = 250_000) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest entry ids over every key, scanned shard by shard (keys never all in RAM)."""
    best_d = np.full((len(queries), 0), np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    for day in ds.days:
        keys, ids = ds.shards.shard(day.shard, "keys"), np.asarray(ds.shards.shard(day.shard, "ids"))
        for i in range(0, len(ids), chunk):
            dist, at = faiss.knn(queries, np.asarray(keys[i : i + chunk], np.float32), k)
            best_d = np.concatenate([best_d, dist], 1)
            best_i = np.concatenate([best_i, ids[i : i + chunk][at]], 1)
            order = np.argsort(best_d, 1)[:, :k]
            best_d, best_i = np.take_along_axis(best_d, order, 1), np.take_along_axis(best_i, order, 1)
    return best_d, best_i


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "index-scale")
    ap.add_argument("--n", type=int, default=5_000_000, help="keys in all")
    ap.add_argument("--day", type=int, default=500_000, help="keys committed per day")
    ap.add_argument("--codec", default="pq", choices=["pq", "fastscan"])
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--work", type=Path, default=WORK / "index-scale")
    args = ap.parse_args(argv)

    shutil.rmtree(args.work, ignore_errors=True)
    ds = Datastore(args.work, {"model": "synthetic", "hidden_size": D, "tokenizer": "synthetic"})
    index = MemoryIndex(args.work, D, IndexConfig(k=args.k, codec=args.codec))
    keys = Keys()
    days = []
    for t in range(-(-args.n // args.day)):
        n = min(args.day, args.n - t * args.day)
        started = time.perf_counter()
        x = keys.day(t, n, seed=1000 + t)
        ds.commits.commit_day(f"2000-01-{t + 1:02d}" if t < 31 else f"2000-02-{t - 30:02d}",
                      Entries(x.astype(np.float16), np.arange(n, dtype=np.int32), [f"t{t}"] * n, np.arange(n)), n, "fullmem")
        commit_s = time.perf_counter() - started
        stats = index.sync(ds)
        days.append({"day": t, "entries": len(ds), "kind": index.meta["kind"], "codec": index.meta.get("codec", "exact"),
                     "nlist": index.meta.get("nlist", 0), "rebuilt": stats["rebuilt"], "added": stats["added"],
                     "index_s": stats["seconds"], "add_keys_per_s": stats["added"] / stats["seconds"],
                     "probe_recall": stats.get("recall", index.meta.get("recall_at_train")), "commit_s": commit_s})
        print(json.dumps(days[-1]), flush=True)

    queries = keys.day(len(days) - 1, args.queries, seed=7)  # tomorrow's keys look like today's
    started = time.perf_counter()
    exact_d, exact_i = exact_search(ds, queries, args.k)
    exact_s = time.perf_counter() - started
    index.search(queries[:8])  # warm-up
    started = time.perf_counter()
    _, found = index.search(queries)
    search_s = time.perf_counter() - started
    hits = [np.isin(e, f) for e, f in zip(exact_i, found)]
    n, index_bytes = len(ds), index.bytes_on_disk()
    # adds at the final list count (its cap, past 1M keys): what every later day costs per key
    steady = [d for d in days if not d["rebuilt"] and d["kind"] == "ivfpq" and d["nlist"] == index.meta.get("nlist")]
    add_rate = np.median([d["add_keys_per_s"] for d in steady]) if steady else days[-1]["add_keys_per_s"]
    builds = [d for d in days if d["rebuilt"] and d["kind"] == "ivfpq"]
    result = {
        "entries": n, "dims": D, "codec": index.meta.get("codec"), "nlist": index.meta.get("nlist"),
        "nprobe": index.cfg.nprobe, "k": args.k, "threads": faiss.omp_get_max_threads(),
        "add_keys_per_s": add_rate, "build_s": [d["index_s"] for d in builds],
        "queries_per_s": args.queries / search_s, "exact_queries_per_s": args.queries / exact_s,
        "recall_at_k": float(np.mean([h.mean() for h in hits])),
        "top10_in_k": float(np.mean([h[:10].mean() for h in hits])),
        "top1_in_k": float(np.mean([h[0] for h in hits])),
        "nn_dist_median": float(np.median(exact_d[:, 0])), "kth_dist_median": float(np.median(exact_d[:, -1])),
        "index_bytes": index_bytes, "datastore_bytes": ds.bytes_on_disk(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "days": days,
    }
    scale = 100_000_000 / n
    result["projection_100m"] = {
        # adding is linear once nlist is at its cap; retraining at 4x growth re-adds about a third more
        "add_hours": 100_000_000 / add_rate / 3600, "add_hours_with_retrains": 100_000_000 * 4 / 3 / add_rate / 3600,
        # a query scans nprobe lists, whose length grows with the memory at a fixed nlist
        "queries_per_s": result["queries_per_s"] / scale,
        "index_gb": index_bytes * scale / 1e9, "disk_gb": (index_bytes + result["datastore_bytes"]) * scale / 1e9,
    }

    table = Table(title=f"Index at {n:,} keys x {D} ({result['codec']}, nlist {result['nlist']}, nprobe "
                        f"{result['nprobe']}, k {args.k}, {result['threads']} threads)")
    for col in ("measure", f"at {n / 1e6:g}M", "projected to 100M"):
        table.add_column(col, justify="right")
    p = result["projection_100m"]
    table.add_row("add keys/s (incremental)", f"{add_rate:,.0f}", f"{p['add_hours']:.1f} h ({p['add_hours_with_retrains']:.1f} h with retrains)")
    table.add_row("IVF builds (train + add), s", ", ".join(f"{s:.0f}" for s in result["build_s"]), "")
    table.add_row(f"queries/s at k={args.k}", f"{result['queries_per_s']:,.1f} "
                  f"({result['queries_per_s'] / result['exact_queries_per_s']:.0f}x exact)", f"{p['queries_per_s']:,.1f}")
    table.add_row(f"recall@{args.k} | top-10 in {args.k} | top-1", f"{result['recall_at_k']:.3f} | "
                  f"{result['top10_in_k']:.3f} | {result['top1_in_k']:.3f}", "")
    table.add_row("index RAM = file, GB", f"{index_bytes / 1e9:.2f}", f"{p['index_gb']:.1f}")
    table.add_row("disk (keys fp16 + index), GB", f"{(index_bytes + result['datastore_bytes']) / 1e9:.1f}", f"{p['disk_gb']:.0f}")
    table.add_row("peak RSS, GB", f"{result['peak_rss_bytes'] / 1e9:.1f}", "")
    Console(width=130).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, result, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
