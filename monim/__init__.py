"""monim: a kNN-LM whose memory learns what to memorize from a daily news stream (MoNIM)."""

import importlib

__version__ = "0.2.0"  # also the package's (pyproject.toml) and the changelog's latest (docs/changelog.md)

# The public Python names (docs/reference/stability.md), each imported from its module when first asked
# for: `import monim` stays light (no torch) for the command line.
_HOME = {"RunConfig": "monim.core.run_config", "Fields": "monim.core.config", "make_run": "monim.run",
         "open_run": "monim.run", "Memory": "monim.theta.memory", "generate": "monim.serving.generate",
         "GenerateConfig": "monim.serving.generation"}
__all__ = list(_HOME)


def __getattr__(name: str):
    """A public name, from the module that defines it."""
    if name not in _HOME:
        raise AttributeError(f"module 'monim' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
