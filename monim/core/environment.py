"""The environment a monim process needs before torch, Prefect or MLflow is first imported (each reads it
once): its entry points (the command line, the tests, the benchmarks, the deployments) set it, importing
monim sets nothing."""

import os

DEFAULTS = {
    # PyTorch's OpenMP threads spin-wait by default: with 2 threads on a busy 2-core machine that makes
    # it 4-5x slower
    "OMP_WAIT_POLICY": "PASSIVE",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # room for a slow start (stack.md)
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


def set_defaults() -> None:
    """Each of DEFAULTS not already set by the user."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
