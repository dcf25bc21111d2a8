"""Θ's rule as of a memory's day: its last calibration (the constant λ and T, the NN calibrator,
the rule its held-out tokens chose, or the LM alone), λ per token, Θ's scores, and the LM's hook
that searches each token's neighbours where λ can change its answer. Memory is one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from monim.core.atomic import checksum
from monim.theta.calibrator import LAM_CEIL, Calibrator, examples
from monim.storage.datastore import Datastore
from monim.theta.knnlm import (Interpolation, ThetaScores, choose_rule, copies, interpolate, knn_full_logprobs, knn_log_weights,
                         prior_lam, row_lam, theta_scores)
from monim.lm.model import LM
from monim.lm.scoring import Found, TokenScores
from monim.storage.memory_settings import Settings


class ThetaRule:
    """Θ's rule and λ as of a memory's day."""

    ds: Datastore
    lm: LM
    settings: Settings
    as_of: str | None

    def theta(self) -> dict:
        """Θ's settings (λ, T, date, dir): the last calibration, or the last one up to `as_of`."""
        return self.ds.theta_at(self.as_of)

    @property
    def interpolation(self) -> Interpolation:
        """The constant (λ, T) last tuned on validation data (defaults before any tuning)."""
        theta = self.theta()
        return Interpolation(theta["lam"], theta["temperature"]) if theta else Interpolation()

    def theta_dir(self) -> Path | None:
        """The folder of the last calibration (its examples and calibrators), if any."""
        rel = self.theta().get("dir")
        return self.ds.root / rel if rel else None

    def calibrator(self) -> Calibrator | None:
        """The last trained calibrator, if any."""
        folder = self.theta_dir()
        if folder is None:
            return None
        with self._lock:
            if str(folder) not in self._loaded:
                path, want = folder / "calibrator.pt", self.theta().get("checksums", {}).get("calibrator.pt")
                if want is not None and (not path.exists() or checksum(path) != want):
                    raise ValueError(f"{path} is {'damaged' if path.exists() else 'missing'}: Θ as of "
                                     f"{self.theta()['date']} cannot be read (`monim fsck --repair` says what it can do)")
                self._loaded[str(folder)] = Calibrator.load(path, self.lm.hidden_size) if path.exists() else None
            return self._loaded[str(folder)]

    @property
    def rule(self) -> str:
        """How Θ weighs the memory per token (monim.learning.recalibration.RULES): the rule the last calibration's
        held-out tokens chose (monim.learning.recalibration.choose_rule); before any, the calibrator if there is one."""
        nll = self.theta().get("nll")
        if not nll:
            return "calibrator" if self.settings.calibrated and self.calibrator() is not None else "constant"
        return choose_rule(nll, self.settings.calibrated)

    @property
    def fallback(self) -> bool:
        """Whether Θ is the LM alone: every rule did worse than the LM on new held-out text."""
        return self.rule == "lm"

    @property
    def retrieves(self) -> bool:
        """Whether Θ searches this memory (it holds entries and Θ has not fallen back to the LM)."""
        return len(self) > 0 and not self.fallback

    def calibration_files(self) -> list[str]:
        """The files of the calibration tokens gathered so far (one per day), relative to the root."""
        folder = self.theta_dir()
        return json.loads((folder / "meta.json").read_text())["examples"] if folder else []

    def lam(self, batch: TokenScores) -> np.ndarray | float:
        """Θ's λ for each token of a searched batch, by the rule: the calibrator's, the prior's (λ_copy
        where the nearest entry is a copy of the token's context), or the constant one."""
        rule, lam = self.rule, self.interpolation.lam
        if batch.knn_values is None:
            return lam
        if rule == "calibrator" and (calibrator := self.calibrator()) is not None:
            return calibrator.lam(examples(batch, self.lexical()))
        if rule == "prior":
            copied = copies(batch.knn_dist[:, 0], batch.key, self.settings.calibrator.copy_tolerance)
            return prior_lam(copied, lam, self.theta().get("lam_copy", lam))
        return lam

    @property
    def lam_max(self) -> float:
        """The largest λ `lam` gives any token by the rule: the constant λ, the prior's larger of λ and
        λ_copy, the calibrator's ceiling (LAM_CEIL, 0.99: bounds Θ so loosely that no decision is
        certain, monim.learning.policies.MoNIM.certain), 0 for the LM alone."""
        rule, lam = self.rule, self.interpolation.lam
        if rule == "lm":
            return 0.0
        if rule == "calibrator" and self.calibrator() is not None:
            return LAM_CEIL
        if rule == "prior":
            return max(lam, self.theta().get("lam_copy", lam))
        return lam

    def theta_scores(self, batch: TokenScores) -> ThetaScores:
        """log P(target), max log P and top-1 of each token under Θ."""
        return theta_scores(batch, self.interpolation, self.lam(batch), device=self.lm.device)

    def theta_logprobs(self, batch: TokenScores, lm_logp: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Θ's log P over the vocabulary [n, V] for the tokens of a searched batch, from the LM's
        (`lm_logp` [n, V]); with each token's λ [n] and its neighbours' kNN weights [n, k]."""
        values = torch.from_numpy(batch.knn_values).long()
        prior = None if batch.knn_prior is None else torch.from_numpy(batch.knn_prior)
        logw = knn_log_weights(torch.from_numpy(batch.knn_dist), values, self.interpolation.temperature, prior)
        lam = row_lam(batch.knn_values, self.lam(batch))
        logp = interpolate(lm_logp, knn_full_logprobs(logw, values, lm_logp.shape[-1]), lam)
        return logp, lam.numpy(), logw.exp().numpy()

    def search(self, batch: TokenScores, skip: bool = True, k: int | None = None,
               wanted: np.ndarray | None = None) -> Found:
        """The LM's hook (monim.lm.scoring.Neighbors): each token's neighbours. With a skip threshold θ
        (calibrator_cfg.skip_threshold), a first search for the `gate_k` nearest entries gives the
        calibrator its neighbour features; tokens whose λ is below θ keep no neighbours (the LM
        alone), unless their nearest entry is a near-exact match (`copy_tolerance`: a repeated
        article); the others are searched in full. `wanted` (bool per token; None: all): the only
        tokens searched at all, the others keep no neighbours (skipped)."""
        cfg, k = self.calibrator_cfg, k or self.index.cfg.k
        wanted = np.ones(len(batch), bool) if wanted is None else np.array(wanted, bool)
        keys = batch.key.astype(np.float32)
        calibrator = self.calibrator() if skip and self.settings.calibrated and cfg.skip_threshold is not None else None
        if calibrator is not None and wanted.any():
            first = dataclasses.replace(batch, knn_dist=None, knn_values=None) if wanted.all() else batch.select(wanted)
            first.knn_dist, first.knn_values = self.neighbors(keys[wanted], cfg.gate_k, exact=True)
            wanted[wanted] = ((calibrator.lam(examples(first, self.lexical())) >= cfg.skip_threshold)
                              | (first.knn_dist[:, 0] <= cfg.copy_tolerance * (keys[wanted]**2).sum(axis=1)))
        dist, ids = np.full((len(batch), k), np.inf, np.float32), np.full((len(batch), k), -1, np.int64)
        if wanted.any():
            dist[wanted], ids[wanted] = self.nearest(keys[wanted], k)
        return Found(dist, self.values_of(ids), ids, self.prior(ids), ~wanted)
