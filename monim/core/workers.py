"""Where a stage's parts run: here (InProcess) or on a cluster's workers (tasks.cluster)."""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Workers(Protocol):
    """Runs a module-level function of monim over picklable items, the results in the items' order."""

    @property
    def size(self) -> int:
        """Parts that run at once (worker threads in all)."""

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]: ...


class InProcess:
    """Workers that are this process: one part at a time."""

    size = 1

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return [fn(x) for x in items]
