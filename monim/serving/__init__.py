"""Serving (layer 6): generation with Θ, a request read and checked in any of MLflow's formats, and
serving it to many callers over one worker. Imports the layers below, evaluation included; never
monim.learning."""
