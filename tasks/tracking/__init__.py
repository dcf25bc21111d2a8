"""Import paths of Θ's pyfunc model for versions registered by monim 0.2.0, when MLflow tracking was here
(tracking/ now): each version carries the theta_model.py of its day."""
