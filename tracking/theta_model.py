"""Θ's pyfunc model as code (MLflow's models-from-code): a registered version carries this file and
its config, not a pickle of the model object."""

from mlflow.models import set_model

from tracking.served_model import MonimModel

set_model(MonimModel())
