"""Prefect tasks: thin wrappers over monim that add retries, caching, logging and artifacts."""

import os

# Set before Prefect or MLflow is first imported (stack.md): no telemetry, room for a slow start.
for _key, _value in {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}.items():
    os.environ.setdefault(_key, _value)
