"""Θ on the LM's device: a memory's keys, values and priors held there, each chunk searched exactly
(monim.storage.torch_search.TorchExact), the skip decided and Θ's λ and scores computed there, so that
scoring reads nothing from the device but each pass's results (monim.lm.scoring)."""

from __future__ import annotations

import copy
import functools
import math
from typing import Callable

import numpy as np
import torch

from monim.core.config import CalibratorConfig
from monim.lm.token_scores import OnDevice
from monim.storage.lexical import LexicalCounts, lexical_features
from monim.storage.torch_search import TorchExact, values_of
from monim.theta.calibrator import Calibrator, density_on, skips
from monim.theta.knnlm import Interpolation, copies, row_lam, theta_of

BUCKETS = 16  # `rows` in sixteenths of a chunk


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
    `rule` (constant `interpolation`, `lam_copy`, `calibrator`); `neighbors`: whether the host reads them back (OnDevice.read_neighbors)."""

    def __init__(self, tables: DeviceTables, k: int, cfg: CalibratorConfig, rule: str, interpolation: Interpolation,
                 lam_copy: float, calibrator: Calibrator | None = None, skip: bool = False, neighbors: bool = True):
        device = tables.index.device
        self.read_neighbors = neighbors
        self.index, self.values, self.prior = tables.index, tables.values, tables.prior
        self.k, self.cfg, self.rule, self.interpolation = k, cfg, rule, interpolation
        self.lam_constant, self.lam_copy = (torch.tensor(lam, dtype=torch.float64, device=device)
                                            for lam in (interpolation.lam, lam_copy))
        self.net = None if calibrator is None else copy.deepcopy(calibrator.net).to(device).eval()
        self.skip = skip and self.net is not None and cfg.skip_threshold is not None
        counts = tables.counts if self.net is not None else None
        self.count: torch.Tensor | None = None if counts is None else counts[0]
        self.distinct: torch.Tensor | None = None if counts is None else counts[1]
        self.kept = 1.0  # the largest share of a chunk's rows the skip kept, as last read (`saw`): at first, all
        self.seen = 0.0  # that share in the last pass read alone

    def _calibrated(self, chunk: dict[str, torch.Tensor], dist: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The calibrator's λ (Calibrator.lam of `examples`) from the chunk and these neighbours, on the device."""
        assert self.net is not None and self.count is not None and self.distinct is not None
        stats, prev = chunk["stats"], chunk["prev"].long()
        distribution = torch.stack([stats[:, 1].exp(), stats[:, 2]], dim=1)
        with torch.no_grad():
            lexical = lexical_features(self.count, self.distinct, prev)
            inputs = self.net.inputs_of(chunk["key"], distribution, lexical, density_on(dist, values))
            return self.net(*inputs)[:, 1].exp().double()

    def rows(self, n: int) -> int | None:
        """How many of a chunk's n rows `search` searches in full (None: all, in one search): the
        largest share of kept rows in a chunk of the passes read so far (`saw`), a sixteenth more, in
        sixteenths (a shape per bucket; powers of two would search every row whenever half are kept)."""
        buckets = math.ceil((self.kept + 1 / BUCKETS) * BUCKETS)
        return None if not self.skip or buckets >= BUCKETS else math.ceil(n * buckets / BUCKETS)

    def saw(self, skipped: np.ndarray, chunk: int) -> None:
        """Size the next searches (`rows`) from a pass's skipped rows read by the host, searched `chunk` at a
        time: the largest kept share of a chunk in this pass and the one before (one pass keeping fewer
        does not make the next outgrow its rows and read again)."""
        if self.skip and len(skipped):
            seen = max(float((~skipped[i : i + chunk]).mean()) for i in range(0, len(skipped), chunk))
            self.kept, self.seen = max(seen, self.seen), seen

    def search(self, chunk: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, torch.Tensor]:
        """Memory.search: the k nearest entries of each key; with the skip, the gate's `gate_k` nearest
        decide (`skips`). Given `rows` (a number the host knows), every key is searched at `gate_k`
        and only the kept rows at k, kept rows first (a stable sort: nothing read), `rows` of them:
        the top-k at k = 1,024 that bounds an exact search on a GPU is saved for the skipped rows;
        kept rows past `rows` are `knn_missed`. Without, every row at k (one search: decoding's few rows)."""
        key, gate = chunk["key"], self.cfg.gate_k if self.skip else 0
        if rows is None:
            dist, ids = self.index.search_on(key, max(self.k, gate))
            skipped = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
            if self.skip:
                skipped = skips(self._calibrated(chunk, dist[:, :gate], values_of(self.values, ids[:, :gate])),
                                dist[:, 0], key, self.cfg)
            dist, ids = dist[:, : self.k].masked_fill(skipped[:, None], torch.inf), ids[:, : self.k].masked_fill(skipped[:, None], -1)
            missed = {"knn_missed": torch.zeros_like(skipped)} if self.skip else {}  # every pass's chunks alike (`rows` may change)
            return self._found(dist, ids, skipped) | missed
        first, near = self.index.search_on(key, gate)
        skipped = skips(self._calibrated(chunk, first, values_of(self.values, near)), first[:, 0], key, self.cfg)
        order = skipped.to(torch.uint8).argsort(stable=True)[:rows]
        dist, ids = self.index.search_on(key[order], self.k)
        gone = skipped[order, None]
        dist = torch.full((len(key), self.k), torch.inf, device=dist.device).index_copy_(0, order, dist.masked_fill(gone, torch.inf))
        ids = torch.full((len(key), self.k), -1, device=ids.device).index_copy_(0, order, ids.masked_fill(gone, -1))
        return self._found(dist, ids, skipped) | {"knn_missed": (~skipped).index_fill(0, order, False)}

    def _found(self, dist: torch.Tensor, ids: torch.Tensor, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        """A search's fields (OnDevice.search) from its neighbours' distances and ids."""
        out = dict(knn_dist=dist, knn_values=values_of(self.values, ids), knn_ids=ids, knn_skipped=skipped)
        if self.prior is not None:
            out["knn_prior"] = torch.where(ids >= 0, self.prior[ids.clamp(min=0)], 0.0)
        return out

    def lam(self, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
        """ThetaRule.lam of a searched chunk, on the device (numbers made there once: a number copied to
        a GPU per chunk would wait for it)."""
        if self.rule == "calibrator" and self.net is not None:
            return self._calibrated(chunk, chunk["knn_dist"], chunk["knn_values"])
        if self.rule == "prior":
            return torch.where(copies(chunk["knn_dist"][:, 0], chunk["key"], self.cfg.copy_tolerance), self.lam_copy, self.lam_constant)
        return self.lam_constant

    def theta(self, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Θ's scores of a searched chunk (ThetaRule.theta_scores), on the device."""
        stats = chunk["stats"]
        logp, max_logp, top = theta_of(stats[:, 0], stats[:, 1], chunk["argmax"], chunk["target"], chunk["knn_dist"],
                                       chunk["knn_values"], chunk["lm_logp_values"], chunk.get("knn_prior"),
                                       row_lam(chunk["knn_values"], self.lam(chunk)), self.interpolation.temperature)
        return dict(theta_logp=logp, theta_max_logp=max_logp, theta_argmax=top.to(torch.int32))
