"""Core (layer 0): the run's typed settings, the catalogue of policies, atomic files, locks, the
manifest's format and recency. Imports nothing else of monim."""
