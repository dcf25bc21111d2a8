"""The versions of Θ in MLflow's Model Registry: a stream and policy's registered model, one version per
committed day and memory state (logged beside the run that learned it), and the version a command names
for a memory (its champion by default). Each function takes the tracking URI first."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from monim.core.run_config import RunConfig
from tracking.logged import MARK, logged_steps, memory_runs, step_of
from tracking.served_model import MODEL_CODE, SIGNATURE
from tracking.store import client, here, one_at_a_time, read_only, sqlite_file

CHAMPION, PREVIOUS = "champion", "previous"  # the aliases: the version served, the one it replaced


def model_versions(uri: str, name: str) -> list:
    """A registered model's versions, oldest first."""
    return sorted(client(uri).search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))


def aliased(uri: str, name: str, alias: str):
    """The version an alias points to, or None where the alias is not set."""
    try:
        return client(uri).get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code == "INVALID_PARAMETER_VALUE" and "not found" in e.message:
            return None
        raise


@one_at_a_time
def model_for(uri: str, cfg: RunConfig, run_id: str) -> str:
    """The registered model of a run's memory, monim-<stream>-<policy>, created on first use: named after
    the experiment its MLflow run is in (a source renamed since keeps its model)."""
    c = client(uri)
    name = f"{c.get_experiment(c.get_run(run_id).info.experiment_id).name}-{cfg.name}"
    if c.search_registered_models(f"name = '{name}'") == []:
        c.create_registered_model(name, tags={"monim.policy": cfg.name},
                                  description=f"Θ of {cfg.name} on {cfg.source}, one version per learned day")
    return name


@one_at_a_time
def new_version(uri: str, name: str, memory: Path, date: str, checksum: str, run_id: str) -> tuple[str, bool]:
    """The version of Θ as of `date` of this memory with this checksum: found, or logged beside the
    run (in it, MLflow would log the config as run params) and registered with its tags."""
    root = str(Path(memory).resolve())
    for v in model_versions(uri, name):
        if (v.tags.get("monim.as_of"), v.tags.get("monim.memory"), v.tags.get("monim.checksum")) == (date, root, checksum):
            return str(v.version), False
    config = {"memory": root, "as_of": date, "checksum": checksum, "overrides": {}}  # Θ's settings: the memory's own
    path, c = f"theta-{date}-{checksum}", client(uri)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():  # saved, then uploaded: no fluent state
        warnings.filterwarnings("ignore", ".*An input example was not provided")  # one would load the LM to check it
        mlflow.pyfunc.save_model(Path(tmp) / path, python_model=str(MODEL_CODE), model_config=config,
                                 signature=SIGNATURE, pip_requirements=["monim"])
        c.log_artifacts(run_id, str(Path(tmp) / path), path)
    tags = {"monim.as_of": date, "monim.memory": root, "monim.checksum": checksum, "monim.run_id": run_id}
    source = f"{c.get_run(run_id).info.artifact_uri}/{path}"  # where it lies: loadable without the tracking URI
    return str(c.create_model_version(name, source, run_id=run_id, tags=tags).version), True


def memory_versions(uri: str, memory: Path) -> list:
    """The versions of Θ of the memory at this path, those recorded where its work directory was before
    it was moved or copied included."""
    c, root = client(uri), str(Path(memory).resolve())
    return c.search_model_versions(f"tags.`monim.memory` = '{root}'") or [
        v for v in c.search_model_versions("") if here(uri, m := v.tags.get("monim.memory", ""), m) == root]


def registered(uri: str, memory: Path) -> str:
    """The registered model of a memory directory's versions, or a clear error."""
    found = memory_versions(uri, memory)
    if not found:
        raise ValueError(f"no registered model for {memory} at {uri} (a day is registered once learned with MLflow on)")
    return found[0].name


def registered_model(uri: str, memory: Path) -> str | None:
    """The registered model of a memory, or None where it has none (learned without MLflow, or no local store)."""
    if (db := sqlite_file(uri)) is not None and not db.exists():
        return None
    try:
        return registered(uri, memory)
    except ValueError:
        return None


@read_only
def find_version(uri: str, memory: Path, version: str | None = None) -> dict:
    """What a registered version of a memory's model is (default: the one `champion` points to):
    model, version, day, memory, checksum and where its files lie."""
    name = registered(uri, memory)
    found = aliased(uri, name, CHAMPION) if version is None else next(
        (v for v in model_versions(uri, name) if str(v.version) == str(version)), None)
    if found is None:
        raise ValueError(f"{name} has {'no champion' if version is None else f'no version {version}'}: "
                         f"`monim promote --workdir ...` sets one")
    return {"model": name, "version": str(found.version), "as_of": found.tags.get("monim.as_of"),
            "memory": here(uri, recorded := found.tags.get("monim.memory", ""), recorded),
            "checksum": found.tags.get("monim.checksum"),
            "uri": here(uri, recorded, client(uri).get_model_version_download_uri(name, found.version))}


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
    versions = memory_versions(uri, memory)
    origin = runs[0].data.tags.get("monim.origin")
    logged = origin is not None and step_of(origin, date) in logged_steps(c, runs[0].info.run_id, MARK)
    return ["registered"] * all(v.tags.get("monim.as_of") != date for v in versions) + ["logged to MLflow"] * (not logged)
