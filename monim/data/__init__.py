"""Data (layer 1): news sources, their day index, the stream of days (attribution, caps, bad
records) and near-duplicate detection; the packaged demo feed lies here. Imports monim.core only."""
