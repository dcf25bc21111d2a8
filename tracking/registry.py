"""The MLflow Model Registry: Θ as of each committed day as a version of a pyfunc model, where
`champion` points, and the model that `mlflow models serve` answers with (the gate that moves the
champion after a learned day: tasks.gate).

A version references, never copies, the memory directory as of its day (time travel), the LM and
the calibrator; a checksum of what Θ reads refuses a memory changed since (e.g. a forgotten article).
The alias `champion` moves to a new version only if its validation PPL is not worse than the
champion's on the same validation articles; `previous` keeps the one it replaced.
"""

from __future__ import annotations

import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

from monim.core.config import RunConfig
from monim.storage.datastore import Datastore
from tracking.store import (
    MARK,
    client,
    experiment_name,
    logged_steps,
    memory_runs,
    one_at_a_time,
    read_only,
    sqlite_file,
    step_of,
)

if TYPE_CHECKING:
    from monim.serving.service import Service
    from monim.theta.memory import Memory

MODEL_CODE = Path(__file__).with_name("theta_model.py")  # MonimModel, as MLflow logs a model from code
CHAMPION, PREVIOUS = "champion", "previous"
CHAMPION_MOVED = "monim.champion.moved"  # the Prefect event each move of `champion` emits
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "text", required=False), ColSpec("string", "prompt", required=False)]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0),
                        ParamSpec("top_p", "double", 1.0), ParamSpec("seed", "long", 0), ParamSpec("sources", "long", 3)]),
)


def model_name(cfg: RunConfig, uri: str | None = None, run_id: str | None = None) -> str:
    """The registered model of a stream and policy, monim-<stream>-<policy>: named after the experiment
    its MLflow run is in (where one is given: a source renamed since keeps its model), else its source."""
    experiment = experiment_name(cfg.source)
    if run_id is not None:
        c = client(uri)
        experiment = c.get_experiment(c.get_run(run_id).info.experiment_id).name
    return f"{experiment}-{cfg.name}"


def open_memory(config: dict) -> Memory:
    """Θ a version references: its memory as of its day (in the work directory of the store it is loaded
    through, where that was moved or copied since), opened as it describes itself (with the version's
    read overrides, if any); refused if what Θ reads has changed since."""
    from monim.theta.memory import (
        Memory,  # the LM and the index load only where a version does: bookkeeping stays light
    )

    root = here(mlflow.get_tracking_uri(), config["memory"], config["memory"])  # loaded through a copy's store: the copy's
    memory = Memory.open(root, as_of=config["as_of"], **config.get("overrides", {}))
    found = memory.checksum()
    if found != config["checksum"]:
        raise MlflowException(f"{root} as of {config['as_of']} has changed since this model version was "
                              f"registered (checksum {found}, registered {config['checksum']}): register it again")
    return memory


class MonimModel(mlflow.pyfunc.PythonModel):
    """Θ as of one day, answering through monim.serving.service.Service: rows with `text` get its PPL (and
    the LM's), rows with `prompt` a continuation with sources; params max_new_tokens, temperature,
    top_p, seed, sources. Concurrent calls (a server's threads) are answered one worker at a time,
    their texts scored in one LM pass; the limits are monim.serving.service.Limits'. Its memory is pinned
    (Memory.pin): a forget after loading does not break it."""

    def load_context(self, context) -> None:
        self.memory = open_memory(context.model_config).pin()
        self._service: Service | None = None
        self._started = threading.Lock()

    @property
    def service(self) -> Service:
        """The service answering with this model's Θ (its worker started on first use)."""
        from monim.serving.service import Service

        with self._started:
            if self._service is None:
                self._service = Service(self.memory)
            return self._service

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> list[dict]:
        """The answers to rows given in any form pandas.DataFrame takes (MLflow makes the DataFrame: from
        records, a dict of columns or of one value each), read as the HTTP server reads MLflow's formats."""
        if len(model_input) == 1 and any(isinstance(v, (list, np.ndarray)) for v in model_input.iloc[0]):
            # MLflow hands a dict of columns (lists) over as one row of lists: read it as the columns
            body = {"inputs": {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in model_input.iloc[0].items()}}
        else:
            body = {"dataframe_records": model_input.to_dict(orient="records")}  # a row without a field: NaN, as none
        from monim.serving.service import BadRequest, Busy

        try:
            return self.service.answer(body | {"params": params or {}})
        except BadRequest as e:
            raise MlflowException.invalid_parameter_value(str(e))  # HTTP 400 from the scoring server
        except Busy as e:
            raise MlflowException(str(e), error_code=TEMPORARILY_UNAVAILABLE)  # HTTP 503


def _versions(c, name: str) -> list:
    return sorted(c.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))


def aliased(c, name: str, alias: str):
    """The version an alias points to, or None where the alias is not set."""
    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code == "INVALID_PARAMETER_VALUE" and "not found" in e.message:
            return None
        raise


def point_champion(c, name: str, version: str, reason: str) -> None:
    """Point `champion` at a version and say so: a Prefect event, `monim.champion.moved` (resource
    `monim.model.<name>`; payload model, version, day, reason), that automations can trigger on
    where a Prefect API is configured (a daily deployment's server; a command's own API has no listener)."""
    c.set_registered_model_alias(name, CHAMPION, str(version))
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        from prefect.events import emit_event

        day = c.get_model_version(name, str(version)).tags.get("monim.as_of")
        emit_event(CHAMPION_MOVED, resource={"prefect.resource.id": f"monim.model.{name}", "prefect.resource.name": name},
                   payload={"model": name, "version": str(version), "day": day, "reason": reason})


def move_champion(c, name: str, version: str, reason: str) -> dict:
    """Point `champion` at a version (`reason`: new day, promote), and `previous` at the champion it replaces."""
    old = aliased(c, name, CHAMPION)
    old = None if old is None else str(old.version)  # (this MLflow returns it as an int)
    if old is not None and old != str(version):
        c.set_registered_model_alias(name, PREVIOUS, old)
    point_champion(c, name, version, reason)
    kept = aliased(c, name, PREVIOUS)
    return {"champion": str(version), "previous": None if kept is None else str(kept.version)}


@one_at_a_time
def new_version(name: str, root: Path, date: str, checksum: str, run_id: str, uri: str) -> tuple[str, bool]:
    """The version of Θ as of `date` of this memory with this checksum: found, or logged beside the
    run (in it, MLflow would log the config as run params) and registered with its tags."""
    c, root = client(uri), str(Path(root).resolve())
    for v in _versions(c, name):
        if (v.tags.get("monim.as_of"), v.tags.get("monim.memory"), v.tags.get("monim.checksum")) == (date, root, checksum):
            return str(v.version), False
    config = {"memory": root, "as_of": date, "checksum": checksum, "overrides": {}}  # Θ's settings: the memory's own
    path = f"theta-{date}-{checksum}"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():  # saved, then uploaded: no fluent state
        warnings.filterwarnings("ignore", ".*An input example was not provided")  # one would load the LM to check it
        mlflow.pyfunc.save_model(Path(tmp) / path, python_model=str(MODEL_CODE), model_config=config,
                                 signature=SIGNATURE, pip_requirements=["monim"])
        c.log_artifacts(run_id, str(Path(tmp) / path), path)
    tags = {"monim.as_of": date, "monim.memory": root, "monim.checksum": checksum, "monim.run_id": run_id}
    source = f"{c.get_run(run_id).info.artifact_uri}/{path}"  # where it lies: loadable without the tracking URI
    return str(c.create_model_version(name, source, run_id=run_id, tags=tags).version), True


@one_at_a_time
def model_for(cfg: RunConfig, run_id: str, uri: str) -> str:
    """The registered model of a run's memory, created on first use."""
    c, name = client(uri), model_name(cfg, uri, run_id)
    if c.search_registered_models(f"name = '{name}'") == []:
        c.create_registered_model(name, tags={"monim.policy": cfg.name},
                                  description=f"Θ of {cfg.name} on {cfg.source}, one version per learned day")
    return name


@one_at_a_time
def settle(name: str, version: str, champion: str | None, gate: dict, uri: str) -> bool:
    """Log the gate on the version and move `champion` to it if it passed, unless the champion moved
    meanwhile (the gate then compared with another version)."""
    c = client(uri)
    for key, value in gate.items():
        c.set_model_version_tag(name, version, key, str(value))
    now = aliased(c, name, CHAMPION)
    if (None if now is None else str(now.version)) != champion:
        return False
    if champion is None or gate.get("gate_tokens") and not gate["gate_ppl"] > gate["gate_ppl_champion"]:
        move_champion(c, name, version, "new day")
        return True
    return False  # worse, or nothing to compare on (a day without validation articles): the champion stays


def moved(uri: str, memory: str) -> tuple[Path, Path] | None:
    """(where the work directory was, where it is) when a version's memory (`<workdir>/memories/<name>`)
    was recorded in a local store that has been moved or copied since (the store lies in its work
    directory, beside that memory); None where it has not."""
    db, recorded = sqlite_file(uri), Path(memory)
    if db is None or recorded.parent.name != "memories" or recorded.parents[1] == (now := db.resolve().parent):
        return None
    return (recorded.parents[1], now) if (now / "memories" / recorded.name / "manifest.json").exists() else None


def here(uri: str, memory: str, recorded: str) -> str:
    """Where a path or file URI that a version recorded inside its work directory (`memory`: the version's
    memory) lies now: in this store's work directory where that moved or was copied since (a restored
    backup's version reads the backup's files, never the original's)."""
    if (found := moved(uri, memory)) is None:
        return recorded
    old, now = found
    if recorded.startswith("file://"):
        return recorded.replace(old.as_uri(), now.as_uri(), 1)
    return str(now / Path(recorded).relative_to(old))


def memory_versions(c, uri: str, memory: Path) -> list:
    """The versions of Θ of the memory at this path, those recorded where its work directory was before
    it was moved or copied included."""
    root = str(Path(memory).resolve())
    return c.search_model_versions(f"tags.`monim.memory` = '{root}'") or [
        v for v in c.search_model_versions("") if here(uri, m := v.tags.get("monim.memory", ""), m) == root]


def registered(uri: str, memory: Path) -> str:
    """The registered model of a memory directory's versions, or a clear error."""
    found = memory_versions(client(uri), uri, memory)
    if not found:
        raise ValueError(f"no registered model for {memory} at {uri} (a day is registered once learned with MLflow on)")
    return found[0].name


@read_only
def find_version(uri: str, memory: Path, version: str | None = None) -> dict:
    """What a registered version of a memory's model is (default: the one `champion` points to):
    model, version, day, memory, checksum and where its files lie."""
    c, name = client(uri), registered(uri, memory)
    found = aliased(c, name, CHAMPION) if version is None else next(
        (v for v in _versions(c, name) if str(v.version) == str(version)), None)
    if found is None:
        raise ValueError(f"{name} has {'no champion' if version is None else f'no version {version}'}: "
                         f"`monim promote --workdir ...` sets one")
    return {"model": name, "version": str(found.version), "as_of": found.tags.get("monim.as_of"),
            "memory": here(uri, recorded := found.tags.get("monim.memory", ""), recorded),
            "checksum": found.tags.get("monim.checksum"),
            "uri": here(uri, recorded, c.get_model_version_download_uri(name, found.version))}


def load_theta(version: dict) -> Memory:
    """A version found by find_version, loaded as MLflow loads it (its memory pinned), reading the memory
    find_version says (this work directory's): Θ, ready to answer."""
    model = mlflow.pyfunc.load_model(version["uri"], model_config={"memory": version["memory"]})
    return model.unwrap_python_model().memory


def changed_since(memory: Path, as_of: str, registered_as: str | None) -> str | None:
    """The checksum a memory's day has now where it differs from the one a version registered (the
    version can no longer load: a forget changed its day); None while it loads."""
    now = Datastore.read(memory).checksum(as_of)
    return None if registered_as is None or now == registered_as else now


def _loadable(name: str, version, memory: Path) -> None:
    """Refuse a version that can no longer load, naming the command that registers its day's state."""
    as_of = version.tags.get("monim.as_of")
    if changed_since(memory, as_of, version.tags.get("monim.checksum")):
        raise ValueError(f"{name} version {version.version} (Θ as of {as_of}) can no longer load: {memory} changed "
                         f"since it was registered; `monim register --as-of {as_of}` registers the day's state")


@one_at_a_time
def promote(uri: str, memory: Path, version: str | None = None) -> dict:
    """Move `champion` by hand (default: to the newest version); `previous` keeps the one it replaces.
    A version that can no longer load is refused."""
    c, name = client(uri), registered(uri, memory)
    versions = {str(v.version): v for v in _versions(c, name)}
    version = str(version or list(versions)[-1])
    if version not in versions:
        raise ValueError(f"{name} has no version {version}; it has {', '.join(versions)}")
    _loadable(name, versions[version], memory)
    return {"model": name} | move_champion(c, name, version, "promote")


@one_at_a_time
def rollback(uri: str, memory: Path) -> dict:
    """Move `champion` back to `previous` (which is then cleared), unless that can no longer load."""
    c, name = client(uri), registered(uri, memory)
    back = aliased(c, name, PREVIOUS)
    if back is None:
        raise ValueError(f"{name} has no 'previous' version to roll back to")
    _loadable(name, back, memory)
    point_champion(c, name, str(back.version), "rollback")
    c.delete_registered_model_alias(name, PREVIOUS)
    return {"model": name, "champion": str(back.version), "previous": None}


def registered_model(uri: str, memory: Path) -> str | None:
    """The registered model of a memory, or None where it has none (learned without MLflow, or no local store)."""
    if (db := sqlite_file(uri)) is not None and not db.exists():
        return None
    try:
        return registered(uri, memory)
    except ValueError:
        return None


def stale_champion(uri: str, memory: Path) -> dict | None:
    """The champion of a memory's model if it can no longer load (what it reads changed since it was
    registered: a forget), with the checksum its day has now; None if it loads, or there is none."""
    try:
        champion = find_version(uri, memory)
    except ValueError:  # no registered model, or no champion
        return None
    now = changed_since(memory, champion["as_of"], champion["checksum"])
    return None if now is None else champion | {"checksum_now": now}


@read_only
def untracked(uri: str, memory: Path, date: str) -> list[str]:
    """What MLflow lacks of a memory's committed day where an MLflow run learns the memory: "registered"
    (no version of Θ as of the day) and "logged to MLflow" (no step of the day in the run)."""
    if (db := sqlite_file(uri)) is not None and not db.exists():
        return []
    c = client(uri)
    runs = memory_runs(c, memory, 1)
    if not runs:
        return []
    versions = memory_versions(c, uri, memory)
    origin = runs[0].data.tags.get("monim.origin")
    logged = origin is not None and step_of(origin, date) in logged_steps(c, runs[0].info.run_id, MARK)
    return ["registered"] * all(v.tags.get("monim.as_of") != date for v in versions) + ["logged to MLflow"] * (not logged)


@one_at_a_time
def register_state(uri: str, memory: Path, as_of: str | None = None) -> dict:
    """Register a memory's current state (its last day, the day `as_of` and the champion's day) as new
    versions where that state is not registered yet. A champion that can no longer load (a forget
    changed its day) is replaced, with no gate, by its day's new version (the same day without what
    was forgotten), or by the last day's where its day was forgotten whole; `previous` is kept."""
    c, name, ds = client(uri), registered(uri, memory), Datastore.read(memory)
    if not ds.days:
        raise ValueError(f"{memory} holds no committed day to register")
    if as_of is not None and not ds.committed(as_of):
        raise ValueError(f"{memory} has no committed day {as_of}; its days: {ds.days[0].date} to {ds.days[-1].date}")
    stale, last = stale_champion(uri, memory), ds.days[-1].date
    replacing = None if stale is None else stale["as_of"] if ds.committed(stale["as_of"]) else last
    days = {as_of or last, last} | ({replacing} if replacing else set())
    newest = _versions(c, name)[-1]
    run_id = newest.tags.get("monim.run_id")  # the versions' artifacts go beside the newest's
    if run_id is None:
        raise ValueError(f"{name} version {newest.version} names no MLflow run (tag monim.run_id) to log beside")
    out = {"model": name, "registered": {}}
    for day in sorted(days):
        version, new = new_version(name, memory, day, ds.checksum(day), run_id, uri)
        out["registered"][day] = {"version": version, "new": new}
    if stale:
        champion = _replace_champion(uri, name, stale["version"], out["registered"][replacing]["version"])
        out |= {"champion": champion, "replaced": stale["version"]}
    return out


@one_at_a_time
def _replace_champion(uri: str, name: str, expected: str, version: str) -> str | None:
    """Point `champion` at `version` where it still points at `expected` (which can no longer load, so
    `previous` stays as it is: a rollback must not return to it); where `champion` points after."""
    c = client(uri)
    now = aliased(c, name, CHAMPION)
    if now is not None and str(now.version) == str(expected):
        point_champion(c, name, version, "forget")
        return str(version)
    return None if now is None else str(now.version)
