"""Prefect flows: one day, a stream of days, a policy comparison, and the daily schedule's flow."""

import tasks  # noqa: F401  (sets Prefect's and MLflow's environment before either is imported)
