"""Entries to memorize: keys with their values and provenance, and the dtypes a shard keeps them in."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DTYPES = {"keys": np.float16, "values": np.int32, "ids": np.int64, "docs": np.int32, "positions": np.int32}


@dataclass
class Entries:
    """Entries to memorize: keys with their values and provenance (document id, position)."""

    keys: np.ndarray  # float16 [n, d]
    values: np.ndarray  # int32 [n]
    doc_ids: list[str]  # per entry
    positions: np.ndarray  # int32 [n]

    def __len__(self) -> int:
        return len(self.values)

    def take(self, keep: np.ndarray) -> Entries:
        """The entries where `keep` is true."""
        return Entries(self.keys[keep], self.values[keep], [d for d, k in zip(self.doc_ids, keep) if k], self.positions[keep])

    @classmethod
    def concat(cls, parts: list[Entries], hidden_size: int) -> Entries:
        """Many batches' entries as one."""
        if not parts:
            return cls(np.zeros((0, hidden_size), np.float16), np.zeros(0, np.int32), [], np.zeros(0, np.int32))
        return cls(np.concatenate([p.keys for p in parts]), np.concatenate([p.values for p in parts]),
                   [d for p in parts for d in p.doc_ids], np.concatenate([p.positions for p in parts]))
