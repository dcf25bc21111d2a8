"""fsck of a work directory: every memory against its manifest, run records against memories, and
MLflow's steps against run records; with `repair`, what is derived is rebuilt (a damaged calibrator
trained again). No Prefect run: a check is quick and leaves nothing behind."""

from __future__ import annotations

from monim.storage.fsck import check_memory, check_records
from monim.storage.workdirs import memories
from tasks.tracking.registry import register_state, registered_model, stale_champion
from tasks.tracking.store import check_steps, tracking_uri as resolve_tracking_uri


def check_workdir(workdir: str, tracking_uri: str | None = None, repair: bool = False) -> list[dict]:
    """Every problem found (each with what repair does, and whether it was done)."""
    uri = resolve_tracking_uri(workdir, tracking_uri)
    problems = [p.as_dict() for root in memories(workdir) for p in check_memory(root, repair, _retrain)]
    problems += [p.as_dict() for p in check_records(workdir, repair)]
    return problems + check_steps(uri, workdir, repair) + check_champions(uri, workdir, repair)


def _retrain(ds) -> None:
    """A damaged last calibrator trained again (torch and the calibrator loaded only for this repair)."""
    from monim.learning.recalibration import retrain_calibrator

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
