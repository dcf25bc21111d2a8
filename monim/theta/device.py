"""Θ on the LM's device: a memory's keys, values and priors held there, each chunk searched exactly
(monim.storage.torch_search.TorchExact), the skip decided and Θ's λ and scores computed there, so that
scoring reads nothing from the device but each pass's results (monim.lm.scoring)."""

from __future__ import annotations

import copy
import functools
from typing import Callable

import numpy as np
import torch

from monim.core.config import CalibratorConfig
from monim.lm.token_scores import OnDevice
from monim.storage.lexical import LexicalCounts
from monim.storage.torch_search import TorchExact
from monim.theta.calibrator import Calibrator, density_on
from monim.theta.knnlm import Interpolation, row_lam, theta_of


class DeviceTables:
    """A memory as it stands, held on the LM's device for Θ: the entries a search may find (`index`, a
    view of the memory's keys there: as of its day, within the recency rule's age), each entry's value
    and log prior by id (`values`, `prior`) and its lexical counts (the calibrator's features, copied up
    when first read); made once per state of the memory (Memory.on_device) and read by every DeviceTheta of it."""

    def __init__(self, index: TorchExact, values: torch.Tensor, prior: np.ndarray | None = None,
                 lexical: Callable[[], LexicalCounts] | None = None):
        self.index, self.values, self._lexical = index, values, lexical
        self.prior = None if prior is None else torch.from_numpy(prior).to(index.device)

    @functools.cached_property
    def counts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each token's count and distinct successors in the memorized text (LexicalCounts), on the device."""
        if self._lexical is None:
            return None
        lexical = self._lexical()
        return torch.from_numpy(lexical.count).to(self.index.device), torch.from_numpy(lexical.distinct).to(self.index.device)


class DeviceTheta(OnDevice):
    """A memory as Θ reads it (Memory.search, Memory.theta_scores) on the LM's device (Memory.on_device):
    its `tables` (DeviceTables), its `k` nearest entries, the skip (`skip`, by `calibrator`), and Θ's
    `rule` (constant `interpolation`, `lam_copy`, `calibrator`); `neighbors`: whether the host reads them back (OnDevice)."""

    def __init__(self, tables: DeviceTables, k: int, cfg: CalibratorConfig, rule: str, interpolation: Interpolation,
                 lam_copy: float, calibrator: Calibrator | None = None, skip: bool = False, neighbors: bool = True):
        device = tables.index.device
        self.neighbors = neighbors
        self.index, self.values, self.prior = tables.index, tables.values, tables.prior
        self.k, self.cfg, self.rule, self.interpolation = k, cfg, rule, interpolation
        self.lam_constant, self.lam_copy = (torch.tensor(lam, dtype=torch.float64, device=device)
                                            for lam in (interpolation.lam, lam_copy))
        self.net = None if calibrator is None else copy.deepcopy(calibrator.net).to(device).eval()
        self.skip = skip and self.net is not None and cfg.skip_threshold is not None
        counts = tables.counts if self.net is not None else None
        self.count: torch.Tensor | None = None if counts is None else counts[0]
        self.distinct: torch.Tensor | None = None if counts is None else counts[1]

    def _values(self, ids: torch.Tensor) -> torch.Tensor:
        """Searcher.values_of on the device."""
        return torch.where(ids >= 0, self.values[ids.clamp(min=0)], -1).to(torch.int32)

    def _calibrated(self, chunk: dict[str, torch.Tensor], dist: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The calibrator's λ (Calibrator.lam of `examples`) from the chunk and these neighbours, on the device."""
        assert self.net is not None and self.count is not None and self.distinct is not None
        stats, prev = chunk["stats"], chunk["prev"].long()
        distribution = torch.stack([stats[:, 1].exp(), stats[:, 2]], dim=1)
        if len(self.count):
            known = prev < len(self.count)
            at = torch.where(known, prev, 0)
            counts = torch.stack([torch.where(known, t[at], 0) for t in (self.count, self.distinct)], dim=1)
            lexical = counts.double().log1p().float()  # as LexicalCounts.features
        else:  # nothing memorized yet
            lexical = torch.zeros(len(prev), 2, device=prev.device)
        with torch.no_grad():
            inputs = self.net.inputs_of(chunk["key"], distribution, lexical, density_on(dist, values))
            return self.net(*inputs)[:, 1].exp().double()

    def _copied(self, chunk: dict[str, torch.Tensor], nearest: torch.Tensor) -> torch.Tensor:
        """monim.theta.knnlm.copies on the device."""
        return nearest <= self.cfg.copy_tolerance * (chunk["key"].float() ** 2).sum(dim=1)

    def search(self, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Memory.search: the k nearest entries of each key; with the skip, the gate's first `gate_k` of
        them decide (the calibrator's λ below θ and no near-exact copy: the LM alone), all rows
        searched and the skipped ones' neighbours dropped (leaving them out would need their count
        read by the host)."""
        gate = self.cfg.gate_k if self.skip else 0
        dist, ids = self.index.search_on(chunk["key"], max(self.k, gate))
        skipped = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        if self.skip:
            assert self.cfg.skip_threshold is not None
            first, found = dist[:, :gate], self._values(ids[:, :gate])
            skipped = (self._calibrated(chunk, first, found) < self.cfg.skip_threshold) & ~self._copied(chunk, first[:, 0])
        dist = dist[:, : self.k].masked_fill(skipped[:, None], torch.inf)
        ids = ids[:, : self.k].masked_fill(skipped[:, None], -1)
        out = dict(knn_dist=dist, knn_values=self._values(ids), knn_ids=ids, knn_skipped=skipped)
        if self.prior is not None:
            out["knn_prior"] = torch.where(ids >= 0, self.prior[ids.clamp(min=0)], 0.0)
        return out

    def lam(self, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
        """ThetaRule.lam of a searched chunk, on the device (numbers made there once: a number copied to
        a GPU per chunk would wait for it)."""
        if self.rule == "calibrator" and self.net is not None:
            return self._calibrated(chunk, chunk["knn_dist"], chunk["knn_values"])
        if self.rule == "prior":
            return torch.where(self._copied(chunk, chunk["knn_dist"][:, 0]), self.lam_copy, self.lam_constant)
        return self.lam_constant

    def theta(self, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Θ's scores of a searched chunk (ThetaRule.theta_scores), on the device."""
        stats = chunk["stats"]
        logp, max_logp, top = theta_of(stats[:, 0], stats[:, 1], chunk["argmax"], chunk["target"], chunk["knn_dist"],
                                       chunk["knn_values"], chunk["lm_logp_values"], chunk.get("knn_prior"),
                                       row_lam(chunk["knn_values"], self.lam(chunk)), self.interpolation.temperature)
        return dict(theta_logp=logp, theta_max_logp=max_logp, theta_argmax=top.to(torch.int32))
