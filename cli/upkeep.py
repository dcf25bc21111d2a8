"""Commands that look after a work directory: fsck, gc, forget, promote, rollback, ui."""

from __future__ import annotations

import time
from pathlib import Path
from subprocess import Popen
from typing import Optional

import typer

from cli.errors import clear_errors, fail, option_date
from cli.learning import print_links, started
from cli.memories import memory_dir
from cli.options import AS_JSON, POLICY, TRACKING, WORKDIR
from cli.output import console, emit, table
from cli.workdir import use_workdir
from servers import local


def fsck(workdir: Path = WORKDIR, repair: bool = typer.Option(False, "--repair", help="Rebuild what is derived (index, "
                                                              "lexical counts, rows, MLflow steps), remove strays and "
                                                              "finish half-finished days (loads the LM)."),
         tracking_uri: Optional[str] = TRACKING, as_json: bool = AS_JSON) -> None:
    """Check every memory against its manifest (shards, checksums, index, strays), runs' rows and
    MLflow's steps against them, and each committed day for its calibration, row, registered version
    and MLflow step; exit status 1 when something is wrong (and not repaired). Without --repair it
    writes nothing (it runs on a full disk)."""
    if not (workdir / "memories").is_dir() and not (workdir / "runs").is_dir():
        raise fail(f"no work directory at {workdir} (no memories/ or runs/)")
    use_workdir(workdir, api=False, prefect=False)  # a check runs no flow: no Prefect at all
    from cli.fsck import check_workdir

    problems = check_workdir(str(workdir), tracking_uri, repair)
    forgotten = forgotten_log(workdir)
    if forgotten:
        console.print(table(f"forgotten in {workdir} (by design: never learned again)", forgotten,
                            ["memory", "when", "what", "reason"]))
    wrong = [p for p in problems if not p["repaired"] and not p.get("warning")]
    if problems:
        console.print(table(f"fsck {workdir}", problems, ["where", "what", "repair", "repaired"]))
    warned = sum(bool(p.get("warning")) for p in problems)
    console.print(f"{len(problems)} problems ({warned} warnings), {sum(p['repaired'] for p in problems)} repaired"
                  if problems else f"{workdir}: clean")
    emit({"clean": not wrong, "problems": problems, "forgotten": forgotten}, as_json)
    if wrong:
        raise typer.Exit(1)


def forgotten_log(workdir: Path) -> list[dict]:
    """What each memory forgot (monim.storage.forgotten), one row per forget; a manifest that cannot be read is fsck's problem."""
    from monim.core.manifest import ManifestError, read_manifest
    from monim.storage.forgotten import summary
    from monim.storage.workdirs import memories

    rows = []
    for root in memories(workdir):
        try:
            rows += [{"memory": root.name} | row for row in summary(read_manifest(root / "manifest.json"))]
        except ManifestError:
            continue
    return rows


def gc(workdir: Path = WORKDIR,
       keep_days: Optional[int] = typer.Option(None, "--keep-days", help="Keep the LM features of the newest N days."),
       max_gb: Optional[float] = typer.Option(None, "--max-gb", help="Then keep the newest features that fit in this "
                                              "many GB."),
       as_json: bool = AS_JSON) -> None:
    """Clean the work directory's feature store (memories are never touched)."""
    from monim.lm.features import gc as clean

    if keep_days is None and max_gb is None:
        raise fail("give --keep-days N and/or --max-gb X")
    out = clean(workdir / "features", keep_days, None if max_gb is None else int(max_gb * 2**30))
    console.print(f"feature store: removed {out['removed']} folders, {out['bytes_before'] / 2**20:.1f} MB -> "
                  f"{out['bytes_after'] / 2**20:.1f} MB")
    emit(out, as_json)


def forget(workdir: Path = WORKDIR,
           doc: Optional[list[str]] = typer.Option(None, "--doc", help="A document id (repeatable)."),
           days: Optional[list[str]] = typer.Option(None, "--day", help="A date, YYYY-MM-DD (repeatable)."),
           policy: Optional[str] = typer.Option(None, "--policy", help="Only this memory (default: all of them)."),
           reason: Optional[str] = typer.Option(None, "--reason", help="Why (a takedown, a privacy request): kept with "
                                                "the forget in the memory's manifest."),
           tracking_uri: Optional[str] = TRACKING, as_json: bool = AS_JSON) -> None:
    """Remove retracted documents or whole days from the memories, and from their indexes (each
    memory under its write lock: a learn in progress commits first), for good: the forget is recorded
    in the memory, which never learns them again (a later record with a forgotten id is a bad record;
    a forgotten day only comes back by `monim learn --relearn DAY`). Then register each changed
    memory's state again, the champion moving to it where it held what was forgotten (a running
    `monim serve-model` follows within its --follow-seconds). The feed still holds the articles, and
    the registry's older versions that held them are refused at load."""
    from monim.storage.datastore import Datastore
    from monim.storage.forgotten import forgotten_ids
    from monim.storage.workdirs import memories, write_view

    if not doc and not days:
        raise fail("give --doc ID or --day DATE")
    days = [option_date(d).isoformat() for d in days or []]  # "not a date" before anything is read
    roots = [memory_dir(workdir, policy)] if policy else memories(workdir)
    stores = [Datastore.read(root) for root in roots]
    held = {d for ds in stores for rec in ds.days for d in ds.shards.shard_seen(rec.shard)}  # every article a day read,
    held |= {d for ds in stores for d in forgotten_ids(ds.manifest)}  # and those forgotten (a forget again changes nothing)
    dates = {rec.date for ds in stores for rec in ds.days}
    unknown = [f"document {d!r}" for d in doc or [] if d not in held] + [f"day {d}" for d in days if d not in dates]
    if unknown:
        raise fail(f"no memory in {workdir} holds {', '.join(unknown)} (nothing was removed)")
    removed, registered, before = {}, {}, {ds.root.name: ds.checksum() for ds in stores}
    from monim.theta.memory import Memory

    for root in roots:
        with clear_errors(ValueError):
            memory = Memory.open(root, removing=tuple(days))  # a damaged day is forgotten, never copied into another commit
            with memory.writing():
                removed[root.name] = memory.forget(doc_ids=doc, days=days, reason=reason, store=workdir / "features")
                write_view(workdir, root.name)  # a forgotten last day's row goes with it
    console.print(f"removed entries: {removed}")
    for root in roots:  # changed: entries, or an article only (what In-Context RALM retrieves)
        if Datastore.read(root).checksum() != before[root.name] and (done := _register(workdir, root, tracking_uri)):
            registered[root.name] = done
            console.print(_registered_line(done), highlight=False)
    emit({"removed": removed, "registered": registered}, as_json)


def _register(workdir: Path, root: Path, tracking: Optional[str], as_of: Optional[str] = None) -> dict | None:
    """A memory's state registered again (tracking.champion.register_state); None where it has no registered model."""
    use_workdir(workdir, api=False)
    from tracking.champion import register_state
    from tracking.store import tracking_uri
    from tracking.versions import registered_model

    uri = tracking_uri(str(workdir), tracking)
    if registered_model(uri, root) is None:  # learned without MLflow: nothing registered to follow
        return None
    with clear_errors(ValueError):
        return register_state(uri, root, as_of)


def _registered_line(done: dict) -> str:
    versions = ", ".join(f"{day}: version {v['version']}{'' if v['new'] else ' (already registered)'}"
                         for day, v in done["registered"].items())
    moved = (f"; champion version {done['replaced']} could no longer load: champion is now version {done['champion']}"
             if "replaced" in done else "")
    return f"{done['model']}: {versions}{moved}"


def register(workdir: Path = WORKDIR, policy: Optional[str] = POLICY,
             as_of: Optional[str] = typer.Option(None, "--as-of", metavar="YYYY-MM-DD", help="The day whose state to "
                                                 "register (default: the memory's last)."),
             tracking_uri: Optional[str] = TRACKING, as_json: bool = AS_JSON) -> None:
    """Register a memory's current state as a new version of its model (where not registered yet);
    a champion that can no longer load (the memory changed since) is replaced by its day's new version."""
    root = memory_dir(workdir, policy)
    done = _register(workdir, root, tracking_uri, None if as_of is None else option_date(as_of).isoformat())
    if done is None:
        raise fail(f"{root} has no registered model (its days were learned without MLflow)")
    console.print(_registered_line(done), highlight=False)
    emit(done, as_json)


def _registry_call(workdir: Path, policy: Optional[str], tracking: Optional[str], fn, *args) -> dict:
    """A tracking.champion function on the memory's registered model, or a clear error."""
    root = memory_dir(workdir, policy)
    use_workdir(workdir, api=False)
    from tracking.store import tracking_uri

    with clear_errors(ValueError):
        return fn(tracking_uri(str(workdir), tracking), root, *args)


def promote(workdir: Path = WORKDIR, policy: Optional[str] = POLICY,
            version: Optional[str] = typer.Option(None, "--version", help="The version to serve (default: the newest)."),
            tracking_uri: Optional[str] = TRACKING, as_json: bool = AS_JSON) -> None:
    """Point the registered model's `champion` alias at a version by hand (`previous` keeps the old one)."""
    from tracking.champion import promote as promote_version

    result = _registry_call(workdir, policy, tracking_uri, promote_version, version)
    console.print(f"{result['model']}: champion is version {result['champion']} (previous: {result['previous']})")
    emit(result, as_json)


def rollback(workdir: Path = WORKDIR, policy: Optional[str] = POLICY, tracking_uri: Optional[str] = TRACKING,
             as_json: bool = AS_JSON) -> None:
    """Move `champion` back to the `previous` version."""
    from tracking.champion import rollback as rollback_version

    result = _registry_call(workdir, policy, tracking_uri, rollback_version)
    console.print(f"{result['model']}: champion is version {result['champion']} again")
    emit(result, as_json)


def ui(workdir: Path = WORKDIR, prefect_port: int = typer.Option(4200, "--prefect-port", help="The Prefect UI's port."),
       mlflow_port: int = typer.Option(5000, "--mlflow-port", help="The MLflow UI's port.")) -> None:
    """Start the Prefect UI and the MLflow UI on 127.0.0.1 over the work directory; Ctrl-C stops both."""
    use_workdir(workdir, api=False)
    prefect_port, mlflow_port = local.free_port(prefect_port), local.free_port(mlflow_port)
    procs: list[Popen] = []
    try:
        procs.append(started(local.prefect_server, prefect_port))
        procs.append(started(local.mlflow_server, mlflow_port, workdir))
        print_links(workdir, f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}")
        console.print("Ctrl-C stops both.")
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        local.stop(procs)
