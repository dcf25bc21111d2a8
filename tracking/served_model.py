"""The served model: Θ as of one day as MLflow's pyfunc model (MonimModel), which `mlflow models serve`
and `monim serve-model` answer with. A registered version (tracking.versions) carries theta_model.py
(MLflow's models-from-code) and its config: the memory as of its day, referenced, never copied, and a
checksum of what Θ reads, which refuses a memory changed since (e.g. a forgotten article).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.pyfunc import PythonModel
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

from tracking.store import here

if TYPE_CHECKING:
    from monim.serving.service import Service
    from monim.theta.memory import Memory

MODEL_CODE = Path(__file__).with_name("theta_model.py")  # MonimModel, as MLflow logs a model from code
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "text", required=False), ColSpec("string", "prompt", required=False)]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0),
                        ParamSpec("top_p", "double", 1.0), ParamSpec("seed", "long", 0), ParamSpec("sources", "long", 3)]),
)


def open_memory(uri: str, config: dict) -> Memory:
    """Θ a version references: its memory as of its day (in the work directory of the store at `uri`, the
    one it is loaded through, where that was moved or copied since), opened as it describes itself (with
    the version's read overrides, if any); refused if what Θ reads has changed since."""
    from monim.theta.memory import (
        Memory,  # the LM and the index load only where a version does: bookkeeping stays light
    )

    root = here(uri, config["memory"], config["memory"])
    memory = Memory.open(root, as_of=config["as_of"], **config.get("overrides", {}))
    found = memory.checksum()
    if found != config["checksum"]:
        raise MlflowException(f"{root} as of {config['as_of']} has changed since this model version was "
                              f"registered (checksum {found}, registered {config['checksum']}): register it again")
    return memory


class MonimModel(PythonModel):
    """Θ as of one day, answering through monim.serving.service.Service: rows with `text` get its PPL (and
    the LM's), rows with `prompt` a continuation with sources; params max_new_tokens, temperature,
    top_p, seed, sources. Concurrent calls (a server's threads) are answered one worker at a time,
    their texts scored in one LM pass; the limits are monim.serving.service.Limits'. Its memory is pinned
    (Memory.pin): a forget after loading does not break it."""

    def load_context(self, context) -> None:
        # the store it is loaded through: a copied work directory's version reads the copy's memory
        self.memory = open_memory(mlflow.get_tracking_uri(), context.model_config).pin()
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


def load_theta(version: dict) -> Memory:
    """A version found by tracking.versions.find_version (which says where its files and its memory lie),
    loaded as MLflow loads it (its memory pinned): Θ, ready to answer."""
    model = mlflow.pyfunc.load_model(version["uri"], model_config={"memory": version["memory"]})
    return model.unwrap_python_model().memory
