"""Where versions registered while the registry was tasks/registry.py import Θ's pyfunc model from: each
carries a copy of the theta_model.py of its day, which says `from tasks.registry import MonimModel`."""

from tracking.served_model import MonimModel  # noqa: F401
