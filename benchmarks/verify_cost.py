"""What a reader's check of the memory costs: the shard checksums at open against the rest of an open.

What a reader's check of the memory costs: Memory.open reads every shard file Θ reads against the
sha256 its commit recorded (monim.storage.verify.verified) before the LM loads. Synthetic memories of
576-dim fp16 keys (SmolLM2-135M's size) over 10 days, written through monim's own Datastore; per
size: the bytes checked, the check's seconds and MB/s with the files in the page cache (as just
written, or read recently) and cold (evicted with posix_fadvise: read from the disk), beside the rest
of a reader's open without the LM and the index (the manifest, every shard mapped, the values table)
and a served memory's look again at its files (monim.storage.verify.looked_again: a stat each).
Usage: monim bench verify-cost [--entries 100000 1000000] [--out docs/results/verify-cost/verify-cost.json]
"""

import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import parser, save
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.storage.datastore import Datastore
from monim.storage.entries import Entries
from monim.storage.verify import looked_again, verified

D, DAYS = 576, 10


def build(root: Path, n: int) -> Datastore:
    """A memory of n random entries over DAYS days."""
    ds = Datastore(root, {"model": "synthetic", "hidden_size": D, "tokenizer": "synthetic"})
    rng = np.random.default_rng(0)
    for t, part in enumerate(np.array_split(np.arange(n), DAYS)):
        keys = rng.standard_normal((len(part), D), np.float32).astype(np.float16)
        values = rng.integers(0, 49152, len(part)).astype(np.int32)
        ds.commits.commit_day(f"2000-01-{t + 1:02d}", Entries(keys, values, [f"d{t}"] * len(part), np.arange(len(part))),
                      len(part), "fullmem")
    return ds


def evict(ds: Datastore) -> None:
    """Drop the shard files from the page cache (clean pages: no root needed)."""
    for path in (ds.root / "shards").rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def measure(root: Path, n: int) -> dict:
    ds = build(root, n)
    size = sum(p.stat().st_size for p in (root / "shards").rglob("*") if p.is_file())
    warm, files = timed(lambda: verified(Datastore.read(root)))
    evict(ds)
    cold, _ = timed(lambda: verified(Datastore.read(root)))

    def open_rest():  # a reader's open but the check, the LM and the index: manifest, shards mapped, values table
        read = Datastore.read(root)
        read.shards.pin()
        read.shards.values_by_id()

    rest, _ = timed(open_rest)
    look, problem = timed(lambda: looked_again(files))
    assert problem is None
    mb = size / 1e6
    return {"entries": n, "days": DAYS, "files": len(files), "mb": round(mb, 1),
            "verify_warm_s": round(warm, 3), "verify_warm_mb_s": round(mb / warm), "verify_cold_s": round(cold, 3),
            "verify_cold_mb_s": round(mb / cold), "open_without_lm_and_index_s": round(rest, 3),
            "look_again_ms": round(look * 1e3, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "verify-cost")
    ap.add_argument("--entries", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--work", type=Path, default=None, help="Where the memories are written (default: a temporary "
                    "folder).")
    args = ap.parse_args(argv)
    rows = []
    for n in args.entries:
        root = Path(tempfile.mkdtemp(prefix=f"verify-{n}-", dir=args.work))
        try:
            rows.append(measure(root, n))
        finally:
            shutil.rmtree(root)
        print(rows[-1], flush=True)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
                         f"{platform.python_version()}", "load_average": [round(x, 1) for x in os.getloadavg()],
              "rows": rows}
    save(args.out, result, args)
    columns = {"entries": "entries", "mb": "MB", "verify_warm_s": "check s (cached)", "verify_warm_mb_s": "MB/s",
               "verify_cold_s": "check s (disk)", "verify_cold_mb_s": "MB/s",
               "open_without_lm_and_index_s": "rest of open s", "look_again_ms": "look again ms"}
    table = Table(title="The reader's check of a memory (Memory.open)")
    for title in columns.values():
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*(str(r[k]) for k in columns))
    Console().print(table)


if __name__ == "__main__":
    main()
