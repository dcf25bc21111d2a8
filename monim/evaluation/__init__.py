"""Evaluation (layer 5): perplexity, the suite (periods, the text probe, the QA quiz) and its report
and plots. Imports the layers below; never monim.learning."""
