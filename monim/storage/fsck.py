"""fsck: a memory against its manifest, and the rows of a work directory's runs against its memories.

The manifest is the truth of a memory: which days are committed (with the checksum of every shard
file, written at commit), evaluated (with their metrics), and Θ's history. The index, the lexical counts, the calibration samples
and the runs' rows are derived from it or must agree with it; `repair` rebuilds or removes what is
derived and names what cannot be recovered (a shard missing or corrupt: which day, how many entries).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from monim.core.atomic import checksum, is_stray, write_json
from monim.core.lock import hold, reading
from monim.core.manifest import CommittedDay
from monim.storage.datastore import Datastore
from monim.storage.entries import DTYPES
from monim.storage.index import MemoryIndex, index_kind, indexed_ids
from monim.storage.lexical import CACHE, LexicalCounts
from monim.storage.memory_settings import Settings
from monim.storage.parts import Parts
from monim.storage.workdirs import rows_file, run_lock, write_view


@dataclass
class Problem:
    """One thing wrong: where, what, and what repair does about it (None: it cannot be recovered). A
    warning is no fault: worth knowing, nothing is wrong with what Θ reads."""

    where: str
    what: str
    repair: str | None
    repaired: bool = False
    warning: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def _shard_problems(ds: Datastore, known: dict | None = None) -> list[Problem]:
    """Each day's shard against the manifest (day_problem), and the entries against the sum over its days."""
    out = [p for day in ds.days if (p := day_problem(ds, day, known))]
    if sum(d.entries for d in ds.days) != len(ds):
        out.append(Problem(str(ds.root / "manifest.json"), "entries differ from the sum over its days", None))
    return out


def day_problem(ds: Datastore, day: CommittedDay, known: dict | None = None) -> Problem | None:
    """A committed day's shard against its commit: its files' checksums and its arrays' lengths (every
    byte read: Memory.open's check too). `known`: checksums already computed, by file, size and time
    (files unchanged since are not read again)."""
    folder = ds.root / "shards" / day.shard
    lost = f"day {day.date}: {day.entries} entries lost"
    if not folder.is_dir():
        return Problem(str(folder), f"shard missing ({lost})", None)
    bad = [f for f, digest in day.checksums.items() if not (folder / f).is_file() or _sha(folder / f, known) != digest]
    if bad:
        return Problem(str(folder), f"{', '.join(bad)} corrupt: checksum differs from the commit's ({lost})", None)
    try:
        lengths = {a: len(ds.shards.shard(day.shard, a)) for a in DTYPES}
    except (OSError, ValueError) as e:
        return Problem(str(folder), f"unreadable: {e} ({lost})", None)
    if set(lengths.values()) != {day.entries}:
        return Problem(str(folder), f"arrays hold {lengths}, the manifest says {day.entries} entries", None)
    return None


def _sha(path: Path, known: dict | None) -> str:
    """A file's sha256, from `known` when its size and modification time are those it was read at."""
    if known is None:
        return checksum(path)
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    entry = known.get(str(path))
    if entry is None or entry[:2] != stamp:
        known[str(path)] = entry = [*stamp, checksum(path)]
    return entry[2]


def damage(root: Path | str) -> list[Problem]:
    """What keeps a memory from taking another day: its shards and calibrations checked (a file read
    again only when it changed since it was last checked: `<memory>/.checked.json`). Called by a
    writer, under the memory's lock."""
    ds, path = Datastore.read(root), Path(root) / ".checked.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    problems = _shard_problems(ds, known) + _theta_problems(ds)
    write_json(path, known)
    return problems


def _strays(ds: Datastore) -> list[Path]:
    """Files no committed state names: interrupted writes, replaced shards, crashed calibrations."""
    root = ds.root
    live_shards = {d.shard for d in ds.days}
    live_theta = {t["dir"].split("/", 1)[1] for t in ds.manifest["thetas"]}
    committed = {d.date for d in ds.days}
    out = [p for p in root.rglob("*") if is_stray(p)]
    out += [p for p in (root / "shards").glob("*") if p.name not in live_shards and not is_stray(p)]
    out += [p for p in (root / "theta").glob("*") if p.name not in live_theta and not is_stray(p)]
    out += [p for p in (root / "calibration").glob("*.npz") if p.stem not in committed]  # sample of an uncommitted day
    return out


def _indexes(ds: Datastore) -> list[tuple[MemoryIndex, Datastore, str]]:
    """The memory's index, the entries it holds and the kind they call for, with the index settings it
    was learned with; each part's where the memory is split (monim.storage.parts)."""
    cfg = Settings.from_dict(ds.manifest.get("settings") or {}).index
    parts = Parts(ds.root, ds.identity["hidden_size"], cfg)
    if not parts.split(ds):
        index = MemoryIndex(ds.root, ds.identity["hidden_size"], cfg)
        return [(index, ds, index_kind(cfg, ds))]
    views = {name: parts.view(ds, name) for name in parts.plan(ds)}
    return [(parts.index(name), view, index_kind(cfg, ds, len(view))) for name, view in views.items()]


def _index_problem(index: MemoryIndex, ds: Datastore, kind: str) -> Problem | None:
    """What is wrong with an index (the memory's or a part's) holding the entries of `ds`."""
    if not (index.dir / "index.faiss").exists():
        if kind == "ivfpq":
            return Problem(str(index.dir), "IVF-PQ index missing (it would be built again at the next search)",
                           "rebuild the index from the shards")
        return None  # an exact index: built in RAM from the shards
    if index.obsolete:
        return Problem(str(index.dir), "an exact index kept on disk, a second copy of every key (monim builds exact "
                                       "indexes in RAM now)", "remove")
    if index.index is None or index.meta.get("sha256", "") not in ("", checksum(index.dir / "index.faiss")):
        return Problem(str(index.dir), "index unreadable or damaged (its checksum differs from its save's)",
                       "rebuild the index from the shards")
    ids = indexed_ids(index.index)
    if index.meta.get("version") != ds.version or len(ids) != len(ds) or not np.array_equal(np.sort(ids), np.sort(ds.shards.array("ids"))):
        return Problem(str(index.dir), f"index holds {len(ids)} entries (version {index.meta.get('version')}), the memory "
                                       f"{len(ds)} (version {ds.version})", "rebuild the index from the shards")
    return None


def _lexical_problem(ds: Datastore) -> Problem | None:
    path = ds.root / CACHE
    if not path.exists():
        return None
    try:  # counts of days the memory no longer holds are recounted on use: only an unreadable file is wrong
        with np.load(path) as f:
            f["count"], f["pairs"], f["shards"]
    except (OSError, ValueError, KeyError) as e:
        return Problem(str(path), f"lexical counts unreadable: {e}", "recount from the shards")
    return None


def _theta_problems(ds: Datastore) -> list[Problem]:
    """Each calibration's files against the checksums the manifest recorded: the last one can be
    trained again from its window's examples, an older one cannot (Θ as of that day is lost)."""
    out = []
    thetas = ds.manifest["thetas"]
    for i, theta in enumerate(thetas):
        folder = ds.root / theta.get("dir", "")
        bad = [f for f, want in theta.get("checksums", {}).items()
               if not (folder / f).is_file() or checksum(folder / f) != want]
        if bad:
            last = i == len(thetas) - 1 and "meta.json" not in bad
            out.append(Problem(str(folder), f"{', '.join(bad)} missing or damaged (Θ as of {theta['date']})",
                               "train the calibrator again from the calibration window" if last else None))
    return out


def check_memory(root: Path | str, repair: bool = False, retrain: Callable[[Datastore], None] | None = None
                 ) -> list[Problem]:
    """Every problem of one memory directory (with `repair`, what can be is rebuilt or removed),
    checked while no writer holds its lock (a writer's half-written day is not a stray): a repair
    holds it, a check only waits for it and writes nothing (it runs on a full disk or a read-only
    mount). A damaged last calibrator is trained again by `retrain` (a model's work, not the
    storage's: without it the problem is reported and left)."""
    root = Path(root)
    with hold(root / ".lock") if repair else reading(root / ".lock"):
        return _check_memory(root, repair, retrain)


def _check_memory(root: Path, repair: bool, retrain: Callable[[Datastore], None] | None) -> list[Problem]:
    try:
        ds = Datastore.read(root)
    except (OSError, ValueError, KeyError) as e:
        return [Problem(str(root / "manifest.json"), f"manifest unreadable: {e}", None)]
    problems = _shard_problems(ds) + _theta_problems(ds)
    problems += [Problem(str(p), "stray (not named by the manifest)", "remove") for p in _strays(ds)]
    indexes = {str(index.dir): (index, held, kind) for index, held, kind in _indexes(ds)}
    problems += [p for p in (*(_index_problem(*i) for i in indexes.values()), _lexical_problem(ds)) if p]
    if str(ds.root / "index") not in indexes and (ds.root / "index" / "index.faiss").exists():
        problems.append(Problem(str(ds.root / "index"), "the whole memory's index, left from before it was split in "
                                                        "parts (monim.storage.parts)", "remove"))
    if repair:
        corrupt = any(p.repair is None for p in problems)
        for p in problems:
            if p.repair == "remove":
                shutil.rmtree(p.where) if Path(p.where).is_dir() else Path(p.where).unlink(missing_ok=True)
            elif p.repair == "recount from the shards":
                Path(p.where).unlink()
                LexicalCounts.of(ds.shards)
            elif p.repair == "rebuild the index from the shards" and not corrupt:
                index, held, kind = indexes[p.where]
                index.sync(held, retrain=True, kind=kind)
            elif p.repair == "train the calibrator again from the calibration window" and retrain:
                retrain(ds)
            else:
                continue
            p.repaired = True
    return problems


def unfinished(ds: Datastore) -> dict[str, list[str]]:
    """The committed days a learn left half-finished (stopped after its commit, e.g. by `kill -9`): date
    -> what the manifest lacks of what the day's recipe writes after the commit ("calibrated", where
    the memory held entries then; "evaluated": its row in runs/<run>.json)."""
    calibrated, evaluated, held, out = {t["date"] for t in ds.manifest["thetas"]}, ds.evaluations(), 0, {}
    for day in ds.days:
        held += day.entries  # a calibration needs entries (monim.learning.calibration.calibrate)
        missing = ["calibrated"] * (held > 0 and day.date not in calibrated) + ["evaluated"] * (day.date not in evaluated)
        if missing:
            out[day.date] = missing
    return out


def check_rows(workdir: Path | str, repair: bool = False) -> list[Problem]:
    """Each run record (a view) against its memory's manifest, which holds the evaluated days (with
    `repair`, the rows are rewritten from the manifest; the stream learns again the days it lacks)."""
    problems = []
    for root in sorted((Path(workdir) / "memories").glob("*")):
        if not (root / "manifest.json").exists():
            continue
        path = rows_file(workdir, root.name)
        with hold(run_lock(workdir, root.name)) if repair else reading(run_lock(workdir, root.name)):
            rows = json.loads(path.read_text()) if path.exists() else {}
            truth = Datastore.read(root).evaluations()
            if rows == truth:
                continue
            extra, missing = sorted(set(rows) - set(truth)), sorted(set(truth) - set(rows))
            what = "; ".join([f"days {', '.join(extra)} recorded but not evaluated in the memory"] * bool(extra) +
                             [f"days {', '.join(missing)} evaluated in the memory but not recorded"] * bool(missing)
                             ) or "rows differ from the memory's"
            problems.append(Problem(str(path), what, "rewrite the rows from the manifest", repair))
            if repair:
                write_view(workdir, root.name)
    return problems
