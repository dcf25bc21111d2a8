"""Prefect flows: one day, a stream of days, a policy comparison, and the daily schedule's flow."""
