"""The scoring data contract: each predicted token's provenance, LM statistics, key and neighbours."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class TokenScores:
    """Per predicted token: provenance, target, LM statistics and the key (a batch of them)."""

    doc_id: np.ndarray  # object array of str
    position: np.ndarray  # int32: index of the target token in its document
    prev: np.ndarray  # int32: the last context token (the one before the target)
    target: np.ndarray  # int32
    logp: np.ndarray  # float32: log P(target)
    max_logp: np.ndarray  # float32: max_y log P(y)
    entropy: np.ndarray  # float32: entropy of P(.) in nats
    argmax: np.ndarray  # int32: the LM's top token
    key: np.ndarray  # float16 [n, hidden]
    # with a memory to search (score(..., neighbors=...)), per token and neighbour [n, k]:
    knn_dist: np.ndarray | None = None  # float32 squared L2 distance (inf: none)
    knn_values: np.ndarray | None = None  # int32 next token stored with the neighbour, -1: none
    lm_logp_values: np.ndarray | None = None  # float32 LM log P of each neighbour's value
    knn_ids: np.ndarray | None = None  # int64 entry id of each neighbour, -1: none
    knn_prior: np.ndarray | None = None  # float32 log prior weight of each neighbour (monim.core.recency), None: 0
    knn_skipped: np.ndarray | None = None  # bool: the skip rule left the token's full search out (the LM alone)
    hidden: np.ndarray | None = None  # float32 [n, hidden] final hidden states (score(..., keep_hidden=True))
    # scored with the memory on the LM's device (OnDevice), per token under Θ: float64 log P(target), max log P, int32 top-1
    theta_logp: np.ndarray | None = None
    theta_max_logp: np.ndarray | None = None
    theta_argmax: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.target)

    @classmethod
    def concat(cls, parts: list[TokenScores]) -> TokenScores:
        """Many batches as one (all with neighbours, or all without)."""
        columns: dict[str, Any] = {f.name: None if getattr(parts[0], f.name) is None
                                   else np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)}
        return cls(**columns)

    def select(self, rows: np.ndarray | slice) -> TokenScores:
        """Some of the tokens, with their LM statistics and key (neighbours and Θ's scores dropped)."""
        dropped = ("knn", "lm_logp", "theta")
        columns: dict[str, Any] = {f.name: None if getattr(self, f.name) is None or f.name.startswith(dropped)
                                   else getattr(self, f.name)[rows] for f in fields(TokenScores)}
        return TokenScores(**columns)


class Found(NamedTuple):
    """Each token's neighbours [n, k]: squared distances, values and entry ids (-1 where none), a
    log prior weight per neighbour (None: all equal), and which tokens the skip rule left unsearched."""

    dist: np.ndarray
    values: np.ndarray
    ids: np.ndarray
    prior: np.ndarray | None = None
    skipped: np.ndarray | None = None


Neighbors = Callable[[TokenScores], Found]  # tokens scored by the LM (no neighbours yet) -> their neighbours


class OnDevice:
    """A memory searched, and Θ applied, on the LM's device (monim.theta.device.DeviceTheta): a chunk's
    tensors in (key, stats, argmax, target, prev), tensors out, nothing read by the host. With
    `read_neighbors` off, the host reads Θ's scores and `knn_skipped` back, not the neighbours ([n, k] each)."""

    read_neighbors: bool = True
    interpolation: Any  # its constant λ and T (monim.theta.knnlm.Interpolation, a layer above)

    def search(self, chunk: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, torch.Tensor]:
        """The chunk's neighbours: knn_dist, knn_values, knn_ids, knn_skipped (and knn_prior where any);
        given `rows` (from `rows`), at most that many rows searched in full, and `knn_missed`: the
        rows the skip kept beyond them (the caller searches their chunk again, with `rows` = its length)."""
        raise NotImplementedError

    def rows(self, n: int) -> int | None:
        """How many of a chunk's n rows to let `search` search in full (None: all, nothing missed)."""
        return None

    def saw(self, skipped: np.ndarray, chunk: int) -> None:
        """What the host read of a pass searched `chunk` rows at a time (its `knn_skipped`): sizes the next `rows`."""

    def lam(self, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
        """Θ's λ of each row of a searched chunk, by its rule."""
        raise NotImplementedError

    def theta(self, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Θ's theta_logp, theta_max_logp and theta_argmax of a searched chunk (with lm_logp_values)."""
        raise NotImplementedError
