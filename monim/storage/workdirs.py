"""The work directory's layout: where each run's memory, weights, rows and lock live (its rows:
each evaluated day, date -> the day's row of metrics, where a stream resumes) and its status.

A memory's manifest holds the row of every day it evaluated (the truth); `runs/<name>.json` is a
view of those rows, rewritten from the manifest after each day (and by `monim fsck --repair`). It
alone holds the bare LM's rows: the bare LM has no memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from monim.core import catalogue
from monim.core.atomic import write_json
from monim.core.lock import hold
from monim.core.manifest import recorded
from monim.storage import forgotten
from monim.storage.datastore import Datastore
from monim.storage.forgotten import forgotten_ids


def rows_file(workdir: str | Path, name: str) -> Path:
    return Path(workdir) / "runs" / f"{name}.json"


def run_lock(workdir: str | Path, name: str) -> Path:
    """The lock a run's stream holds while it learns (one stream per run at a time)."""
    return Path(workdir) / "runs" / f".{name}.lock"


def index_bytes(root: str | Path) -> int:
    """Bytes of a memory's index files (its parts' where it is split: monim.storage.parts), without loading them."""
    files = [Path(root) / "index" / "index.faiss", *Path(root).glob("parts/*/index/index.faiss")]
    return sum(p.stat().st_size for p in files if p.exists())


def memory_root(workdir: str | Path, name: str) -> Path:
    return Path(workdir) / "memories" / name


def run_names(workdir: str | Path) -> list[str]:
    """Every run of the work directory: those with a memory, and the bare LM's if recorded."""
    runs = {p.stem for p in (Path(workdir) / "runs").glob("*.json")}
    return sorted(runs | {p.parent.name for p in (Path(workdir) / "memories").glob("*/manifest.json")})


def read_rows(workdir: str | Path, name: str) -> dict[str, dict]:
    """The run's evaluated days: from its memory's manifest, else (the bare LM) from its rows."""
    root = memory_root(workdir, name)
    if (root / "manifest.json").exists():
        return Datastore.read(root).evaluations()
    path = rows_file(workdir, name)
    return json.loads(path.read_text()) if path.exists() else {}


def write_row(workdir: str | Path, name: str, row: dict, ds: Datastore | None) -> None:
    """Record an evaluated day: in the memory's manifest (under its write lock), then in the view."""
    if ds is None:
        rows_file(workdir, name).parent.mkdir(parents=True, exist_ok=True)
        write_json(rows_file(workdir, name), read_rows(workdir, name) | {row["date"]: row})
        return
    with hold(ds.lock):
        ds.reload()
        ds.commits.record_evaluation(row["date"], row)
        write_view(workdir, name, ds)


def write_view(workdir: str | Path, name: str, ds: Datastore | None = None) -> None:
    """The run's rows rewritten from its memory's manifest (after a day, or a forget or relearn)."""
    path = rows_file(workdir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, (ds or Datastore.read(memory_root(workdir, name))).evaluations())


def memory_status(root: Path) -> dict:
    """A memory's days, tokens seen, entries, MemRate and bytes on disk (no LM needed): `bytes`, its
    entries' (shards and index); `bytes_total`, everything in its folder (Θ's calibrations too)."""
    ds = Datastore.read(root)
    size = ds.bytes_on_disk() + index_bytes(root)
    total = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
    return {"days": len(ds.days), "tokens_seen": ds.tokens_seen, "entries": len(ds), "memrate": ds.memrate,
            "bytes": size, "bytes_per_entry": size / len(ds) if len(ds) else 0.0, "bytes_total": total,
            "model": ds.manifest["model"], "last_day": ds.days[-1].date if ds.days else None,
            "memrate_by_day": {d.date: d.memrate for d in ds.days}, "learned_with": learned_with(root.name, ds.manifest),
            "forgotten": forgotten.summary(ds.manifest)}


def learned_with(name: str, manifest: dict) -> dict:
    """The recorded parameters a memory's policy reads ({"delta": -1.5} for MoNIM's)."""
    policy = recorded(manifest).get("policy", {})
    base = name.removesuffix("-const")
    reads = catalogue.policy_info(base).reads if base in catalogue.names() else tuple(policy)
    return {k: policy[k] for k in reads if k in policy}


def memories(workdir: str | Path) -> list[Path]:
    """The memory directories of a work directory, one per run that keeps a memory."""
    return sorted(p.parent for p in (Path(workdir) / "memories").glob("*/manifest.json"))


def known_ids(root: Path) -> dict[str, tuple[str, str]]:
    """Every article id the memory at `root` read, learned or since forgotten: id -> (its day, what the
    memory did with it), so that a later record with one of them is a bad record (an id names one article)."""
    if not (Path(root) / "manifest.json").exists():
        return {}
    ds = Datastore.read(root)
    out = {i: (d.date, f"{root} learned") for d in ds.days for i in ds.shards.shard_seen(d.shard)}
    return out | {i: (date, f"{root} forgot") for i, date in forgotten_ids(ds.manifest).items()}
