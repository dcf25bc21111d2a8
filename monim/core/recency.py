"""Recency: news goes stale, so Θ may weigh neighbours by the age of their day at query time.

Nothing is deleted. A half-life adds log 2^(-age / half_life) to each neighbour's score -d/T
before the softmax: among a token's neighbours, an older one weighs less than a newer one at the
same distance (halving every half_life days), while λ, and so the memory's share against the LM, is
unchanged. A maximum age leaves the entries of older days out of the search, so the LM (λ = 0 where
no neighbour is left) answers alone. Ages count days from the memory's last day (or its `as_of` day).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Recency:
    """How Θ treats old entries; the defaults leave every entry as it is."""

    half_life: float | None = None  # days: a neighbour's kNN weight halves with every half_life days of age
    max_age: int | None = None  # days: entries learned more than this many days before are not searched

    def __post_init__(self) -> None:
        if self.half_life is not None and not 0 < self.half_life < float("inf"):
            raise ValueError(f"half_life must be a positive, finite number of days, got {self.half_life}")
        if self.max_age is not None and self.max_age < 0:
            raise ValueError(f"max_age must be a number of days >= 0, got {self.max_age}")

    @property
    def active(self) -> bool:
        return self.half_life is not None or self.max_age is not None

    def oldest(self, today: dt.date) -> dt.date | None:
        """The first day whose entries are searched (None: all)."""
        return None if self.max_age is None else today - dt.timedelta(days=min(self.max_age, today.toordinal() - 1))

    def log_prior(self, ages: np.ndarray) -> np.ndarray | None:
        """log 2^(-age / half_life) per neighbour ([n, k] ages in days), or None without a half-life."""
        if self.half_life is None:
            return None
        return (-math.log(2) / self.half_life * ages).astype(np.float32)
