"""Core (layer 0): the run's typed settings, the catalogue of policies, atomic files, locks, the
manifest's format, recency, and what makes text unsafe to read (JSON nested too deep, a lone
surrogate). Imports nothing else of monim."""
