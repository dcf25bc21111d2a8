"""The MLflow Model Registry: Θ as of each committed day as a version of a pyfunc model, the
champion gate, and the model that `mlflow models serve` answers with.

A version references, never copies, the memory directory as of its day (time travel), the LM and
the calibrator; a checksum of what Θ reads refuses a memory changed since (e.g. a forgotten article).
The alias `champion` moves to a new version only if its validation PPL is not worse than the
champion's on the same validation articles; `previous` keeps the one it replaced.
"""

from __future__ import annotations

import datetime as dt
import warnings
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema
from prefect import task
from prefect.cache_policies import NO_CACHE

from monim.config import RunConfig
from monim.evaluate import evaluate, evaluate_many
from monim.generate import GenerateConfig, generate
from monim.index import IndexConfig
from monim.lm import load_lm
from monim.memory import Memory
from monim.stream import Day, Document
from tasks.learning import features_for, logger
from tasks.tracking import client, experiment_name, one_at_a_time

CHAMPION, PREVIOUS = "champion", "previous"
MAX_CHARS = 20_000  # longest text or prompt a request may send
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "text", required=False), ColSpec("string", "prompt", required=False)]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0),
                        ParamSpec("top_p", "double", 1.0), ParamSpec("seed", "long", 0), ParamSpec("sources", "long", 3)]),
)


def model_name(cfg: RunConfig) -> str:
    """The registered model of a stream and policy: monim-<stream>-<policy>."""
    return f"{experiment_name(cfg.source)}-{cfg.name}"


def open_memory(config: dict) -> Memory:
    """The memory a version references, as of its day; refused if what Θ reads has changed since."""
    lm = load_lm(config["model"], config["dtype"])
    memory = Memory(config["memory"], lm, IndexConfig(k=config["k"], nprobe=config["nprobe"], exact_below=config["exact_below"]),
                    use_calibrator=config["calibrated"], as_of=config["as_of"])
    found = memory.checksum()
    if found != config["checksum"]:
        raise MlflowException(f"{config['memory']} as of {config['as_of']} has changed since this model version was "
                              f"registered (checksum {found}, registered {config['checksum']}): register it again")
    return memory


def _bad(message: str) -> MlflowException:
    return MlflowException.invalid_parameter_value(message)  # HTTP 400 from the scoring server


class MonimModel(mlflow.pyfunc.PythonModel):
    """Θ as of one day: rows with `text` get its PPL (and the LM's); rows with `prompt` a continuation
    with sources. Params: max_new_tokens, temperature, top_p, seed, sources (articles per sentence)."""

    def load_context(self, context) -> None:
        self.memory = open_memory(context.model_config)

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> list[dict]:
        params = params or {}
        rows = model_input.to_dict("records") if isinstance(model_input, pd.DataFrame) else None
        if not rows:
            raise _bad("send one or more rows, each with a 'text' (to score) or a 'prompt' (to continue)")
        try:
            cfg = GenerateConfig(int(params.get("max_new_tokens", 64)), float(params.get("temperature", 0.0)),
                                 float(params.get("top_p", 1.0)), int(params.get("seed", 0)), int(params.get("sources", 3)))
        except ValueError as e:
            raise _bad(str(e))
        return [self._answer(i, row, cfg) for i, row in enumerate(rows)]

    def _answer(self, i: int, row: dict, cfg: GenerateConfig) -> dict:
        given = {k: v for k, v in row.items() if k in ("text", "prompt") and isinstance(v, str)}
        if len(given) != 1:
            raise _bad(f"row {i}: give exactly one of 'text' (to score) or 'prompt' (to continue); got {sorted(row)}")
        (field, value), = given.items()
        if not value.strip():
            raise _bad(f"row {i}: '{field}' is empty")
        if len(value) > MAX_CHARS:
            raise _bad(f"row {i}: '{field}' has {len(value)} characters; at most {MAX_CHARS}")
        lm = self.memory.lm
        if field == "text":
            r = evaluate(lm, [Document(f"request-{i}", dt.date.min, value)], self.memory)
            return {"ppl": r["ppl"], "ppl_lm": r["ppl_lm"], "tokens": r["tokens"]}
        try:
            return generate(lm, value, self.memory, cfg).as_dict()
        except ValueError as e:
            raise _bad(f"row {i}: {e}")


def _versions(c, name: str) -> list:
    return sorted(c.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))


def _alias(c, name: str, alias: str):
    """The version an alias points to, or None."""
    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def move_champion(c, name: str, version: str) -> dict:
    """Point `champion` at a version, and `previous` at the champion it replaces."""
    old = _alias(c, name, CHAMPION)
    old = None if old is None else str(old.version)  # (this MLflow returns it as an int)
    if old is not None and old != str(version):
        c.set_registered_model_alias(name, PREVIOUS, old)
    c.set_registered_model_alias(name, CHAMPION, str(version))
    return {"champion": str(version), "previous": old}


def _gate(cfg: RunConfig, day: Day, memory: Memory, champion) -> dict:
    """PPL of the new version and of the champion on the day's validation articles (one LM pass)."""
    champ = Memory(champion.tags["monim.memory"], memory.lm, memory.index.cfg, use_calibrator=cfg.calibrated,
                   as_of=champion.tags["monim.as_of"])
    r = evaluate_many(memory.lm, day.validation, {"new": memory, "champion": champ}, features_for(cfg),
                      f"{day.date}-validation")
    return {"gate_tokens": r["new"]["tokens"], "gate_ppl": r["new"]["ppl"], "gate_ppl_champion": r["champion"]["ppl"]}


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def register_day(cfg: RunConfig, day: Day, memory: Memory, run_id: str, uri: str) -> dict:
    """Register Θ as of a committed day as a new version (once per day), and move `champion` to it
    if its validation PPL is not worse than the champion's; the gate's numbers are logged."""
    c, name, date = client(uri), model_name(cfg), day.date.isoformat()
    if c.search_registered_models(f"name = '{name}'") == []:
        c.create_registered_model(name, tags={"monim.memory": str(cfg.memory_dir.resolve()), "monim.policy": cfg.name},
                                  description=f"Θ of {cfg.name} on {cfg.source}, one version per learned day")
    done = [v for v in _versions(c, name) if v.tags.get("monim.as_of") == date]
    if done:
        return {"model_version": int(done[0].version), "registered": 0}
    config = {"memory": str(cfg.memory_dir.resolve()), "as_of": date, "model": cfg.model, "dtype": cfg.dtype,
              "calibrated": cfg.calibrated, "k": cfg.k, "nprobe": cfg.nprobe, "exact_below": cfg.exact_below,
              "checksum": memory.checksum()}
    mlflow.set_tracking_uri(uri)
    # logged beside the run, not in it: in it, MLflow would log the config as run params (a new as_of a day)
    mlflow.set_experiment(experiment_id=c.get_run(run_id).info.experiment_id)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "An input example was not provided")  # one would load the LM to check it
        info = mlflow.pyfunc.log_model(name=f"theta-{date}", python_model=MonimModel(), model_config=config,
                                       signature=SIGNATURE, pip_requirements=["monim"], registered_model_name=name)
    version = str(info.registered_model_version)
    for key, value in {"monim.as_of": date, "monim.memory": config["memory"], "monim.checksum": config["checksum"],
                       "monim.run_id": run_id}.items():
        c.set_model_version_tag(name, version, key, value)
    champion = _alias(c, name, CHAMPION)
    gate = _gate(cfg, day, memory, champion) if champion is not None else {}
    promoted = champion is None or not gate["gate_tokens"] or not gate["gate_ppl"] > gate["gate_ppl_champion"]
    for key, value in gate.items():
        c.set_model_version_tag(name, version, key, str(value))
    if promoted:
        move_champion(c, name, version)
    logger().info("%s version %s (%s): %s%s", name, version, date, "champion" if promoted else "not promoted",
                  f"; validation PPL {gate['gate_ppl']:.2f} vs champion v{champion.version} {gate['gate_ppl_champion']:.2f}"
                  if gate else "")
    return {"model_version": int(version), "registered": 1, "champion_moved": int(promoted)} | gate


def registered(uri: str, memory: Path) -> str:
    """The registered model of a memory directory, or a clear error."""
    found = client(uri).search_registered_models(f"tags.`monim.memory` = '{Path(memory).resolve()}'")
    if not found:
        raise ValueError(f"no registered model for {memory} at {uri} (a day is registered once learned with MLflow on)")
    return found[0].name


def promote(uri: str, memory: Path, version: str | None = None) -> dict:
    """Move `champion` by hand (default: to the newest version); `previous` keeps the one it replaces."""
    c, name = client(uri), registered(uri, memory)
    versions = [str(v.version) for v in _versions(c, name)]
    version = version or versions[-1]
    if str(version) not in versions:
        raise ValueError(f"{name} has no version {version}; it has {', '.join(versions)}")
    return {"model": name} | move_champion(c, name, str(version))


def rollback(uri: str, memory: Path) -> dict:
    """Move `champion` back to `previous` (which is then cleared)."""
    c, name = client(uri), registered(uri, memory)
    back = _alias(c, name, PREVIOUS)
    if back is None:
        raise ValueError(f"{name} has no 'previous' version to roll back to")
    c.set_registered_model_alias(name, CHAMPION, str(back.version))
    c.delete_registered_model_alias(name, PREVIOUS)
    return {"model": name, "champion": str(back.version), "previous": None}


def aliases(uri: str, memory: Path) -> dict:
    """The registered model's versions (day, gate) and where its aliases point."""
    c, name = client(uri), registered(uri, memory)
    points = {a: str(v.version) if (v := _alias(c, name, a)) else None for a in (CHAMPION, PREVIOUS)}
    versions = [{"version": str(v.version), "as_of": v.tags.get("monim.as_of"), "gate_ppl": v.tags.get("gate_ppl"),
                 "gate_ppl_champion": v.tags.get("gate_ppl_champion")} for v in _versions(c, name)]
    return {"model": name} | points | {"versions": versions}

