"""MLflow: its store, the runs a stream logs to, the charts they are read by, and the Model Registry
that holds Θ as of each day (the champion the served model follows)."""
