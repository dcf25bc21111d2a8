"""Where versions registered before tasks.tracking existed import Θ's pyfunc model from: each carries
a copy of the theta_model.py of its day, which says `from tasks.registry import MonimModel`."""

from tasks.tracking.registry import MonimModel  # noqa: F401
