"""The servers monim runs: the served model over HTTP (`monim serve-model`), and the local Prefect and
MLflow servers of a command, `monim serve` and `monim ui`."""
