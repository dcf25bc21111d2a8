"""Prefect tasks: thin wrappers over monim that add retries, caching, logging and artifacts."""
