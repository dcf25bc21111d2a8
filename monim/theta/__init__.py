"""Θ (layer 4): the semiparametric model: the kNN-LM mixture, the calibrator, a memory as Θ reads it
and retrieval into the prompt (RALM, the baseline). Imports the layers below (core .. storage)."""
