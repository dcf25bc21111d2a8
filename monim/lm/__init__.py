"""The LM (layer 2): loading the frozen backbone, scoring a window of tokens and its features (the
keys, computed once per token). Imports monim.core and monim.data."""
