"""MLflow: its store, the runs a stream logs to, the charts they are read by, the Model Registry's
versions of Θ as of each day, where `champion` points among them, and the served model (Θ as MLflow's pyfunc model)."""
