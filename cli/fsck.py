"""fsck of a work directory: every memory against its manifest, runs' rows against memories,
MLflow's steps against runs' rows, and each committed day against what its recipe writes after the
commit; with `repair`, what is derived is rebuilt (a damaged calibrator trained again) and a
half-finished day finished. A check runs no Prefect flow, loads no LM and writes nothing (it runs on
a full disk); a repair may do all three."""

from __future__ import annotations

import sys
from pathlib import Path

from monim.core.lock import reading
from monim.storage.datastore import Datastore
from monim.storage.fsck import check_memory, check_rows, unfinished
from monim.storage.workdirs import memories, run_lock
from tracking.champion import register_state, stale_champion
from tracking.logged import check_steps, memory_runs, run_config
from tracking.store import client, sqlite_file, tracking_uri as resolve_tracking_uri
from tracking.versions import registered_model, untracked

FINISH = "finish the day as a resume does (`monim learn` again does too; the LM is loaded)"


def check_workdir(workdir: str, tracking_uri: str | None = None, repair: bool = False) -> list[dict]:
    """Every problem found (each with what repair does, and whether it was done)."""
    uri = resolve_tracking_uri(workdir, tracking_uri)
    problems = [p.as_dict() for root in memories(workdir) for p in check_memory(root, repair, _retrain)]
    problems += [p.as_dict() for p in check_rows(workdir, repair)]
    problems += check_steps(uri, workdir, repair)
    return problems + check_days(uri, workdir, repair) + check_champions(uri, workdir, repair)


def _retrain(ds) -> None:
    """A damaged last calibrator trained again (torch and the calibrator loaded only for this repair)."""
    from monim.learning.calibration import retrain_calibrator

    retrain_calibrator(ds)


def check_champions(uri: str, workdir: str, repair: bool = False) -> list[dict]:
    """Each memory's champion against the memory: one that can no longer load (a forget changed its
    day since it was registered) is named; `repair` registers the day's state, which replaces it."""
    problems = []
    for root in memories(workdir):
        if registered_model(uri, root) is None or (stale := stale_champion(uri, root)) is None:
            continue
        replaced = repair and register_state(uri, root).get("champion") != stale["version"]
        problems.append({"where": f"{stale['model']}@champion", "repaired": replaced, "repair": "register the day's "
                         "state and make it the champion (`monim register`)",
                         "what": f"version {stale['version']} (Θ as of {stale['as_of']}) can no longer load: {root} "
                                 f"changed since it was registered (checksum {stale['checksum_now']}, registered "
                                 f"{stale['checksum']})"})
    return problems


def check_days(uri: str, workdir: str, repair: bool = False) -> list[dict]:
    """Each memory's committed days against what a day's recipe (monim.run.Run.day) writes after its
    commit: its calibration, its row in runs/<run>.json, its registered version and its MLflow step.
    A day a learn left half-finished (stopped after the commit, e.g. by `kill -9`) is named with what
    it lacks; `repair` finishes it as a resume does: the stream flow over that day, with the settings
    its MLflow run recorded."""
    problems = []
    for root in memories(workdir):
        try:
            with reading(run_lock(workdir, root.name)):  # not a day a learn is finishing now
                days = unfinished(Datastore.read(root))
        except (OSError, ValueError, KeyError):  # an unreadable manifest: check_memory names it
            continue
        for date, missing in days.items():
            missing += untracked(uri, root, date)
            problem = {"where": str(root), "what": f"day {date} committed but {', '.join('not ' + m for m in missing)}",
                       "repair": FINISH, "repaired": False}
            if repair:
                failed = _finish(uri, workdir, root, date)
                problem |= {"repaired": failed is None} | ({"repair": f"{FINISH}: {failed}"} if failed else {})
            problems.append(problem)
    return problems


def _finish(uri: str, workdir: str, root: Path, date: str) -> str | None:
    """Learn a half-finished day again as a resume does (flows.stream.learn_stream: what the commit
    holds is kept, what follows it done): None, or why it could not be."""
    from monim.core.run_config import RunConfig

    runs = [] if (db := sqlite_file(uri)) is not None and not db.exists() else memory_runs(client(uri), root, 1)
    config = run_config(client(uri), runs[0].info.run_id) if runs else None
    if config is None:
        return "no MLflow run of this memory records its settings: `monim learn` with the run's options finishes it"
    cfg = RunConfig.model_validate(config | {"workdir": workdir})
    if cfg.name != root.name:
        return f"its MLflow run learns {cfg.name!r}, not {root.name!r}"
    if "prefect" not in sys.modules:  # this process's own Prefect API, set before Prefect is imported
        from cli.workdir import use_workdir

        use_workdir(Path(workdir))
    from flows.stream import learn_stream

    try:
        learn_stream(cfg, date, date, tracking_uri=uri)
    except Exception as e:  # noqa: BLE001 (said in the problem's row: the source moved, the LM is gone, ...)
        return f"failed: {type(e).__name__}: {e}"
    return None
