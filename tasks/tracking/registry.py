"""Where a version registered by monim 0.2.0 imports Θ's pyfunc model from: its theta_model.py says
`from tasks.tracking.registry import MonimModel`."""

from tracking.served_model import MonimModel  # noqa: F401
