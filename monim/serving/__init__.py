"""Serving (layer 6): generation with Θ and serving it to many callers over one worker. Imports
the layers below, evaluation included; never monim.learning."""
