"""Θ's rule as of a memory's day: its last calibration (the constant λ and T, the NN calibrator,
the rule its held-out tokens chose, or the LM alone), λ per token and Θ's scores. A Memory owns one.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from monim.core.atomic import checksum
from monim.lm.model import LM
from monim.lm.token_scores import TokenScores
from monim.storage.datastore import Datastore
from monim.storage.lexical import LexicalCounts
from monim.storage.memory_settings import Settings
from monim.theta.calibrator import LAM_CEIL, Calibrator, examples
from monim.theta.knnlm import (
    Interpolation,
    ThetaScores,
    choose_rule,
    copies,
    prior_lam,
    row_lam,
    theta_logprobs,
    theta_scores,
)


class ThetaRule:
    """Θ's rule and λ as of a memory's day."""

    def __init__(self, ds: Datastore, lm: LM, settings: Settings, as_of: str | None,
                 lexical: Callable[[], LexicalCounts]):
        self.ds, self.lm, self.settings, self.as_of = ds, lm, settings, as_of
        self.lexical = lexical  # the memory's counts over its training text (the calibrator's features)
        self._lock = threading.Lock()  # loads each calibrator once when many threads read at once
        self._loaded: dict[str, Calibrator | None] = {}

    def at(self, as_of: str, lexical: Callable[[], LexicalCounts]) -> ThetaRule:
        """The rule as of day `as_of` (reading that day's `lexical` counts), sharing the calibrators loaded."""
        view = copy.copy(self)
        view.as_of, view.lexical = as_of, lexical
        return view

    def reloaded(self) -> None:
        """Load the calibrators again when next asked (the memory's manifest changed)."""
        with self._lock:
            self._loaded.clear()

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
    def name(self) -> str:
        """How Θ weighs the memory per token (monim.learning.calibration.RULES): the rule the last calibration's
        held-out tokens chose (monim.learning.calibration.choose_rule); before any, the calibrator if there is one."""
        nll = self.theta().get("nll")
        if not nll:
            return "calibrator" if self.settings.calibrated and self.calibrator() is not None else "constant"
        return choose_rule(nll, self.settings.calibrated)

    @property
    def fallback(self) -> bool:
        """Whether Θ is the LM alone: every rule did worse than the LM on new held-out text."""
        return self.name == "lm"

    def calibration_files(self) -> list[str]:
        """The files of the calibration tokens gathered so far (one per day), relative to the root."""
        folder = self.theta_dir()
        return json.loads((folder / "meta.json").read_text())["examples"] if folder else []

    def lam(self, batch: TokenScores, rule: str | None = None) -> np.ndarray | float:
        """Θ's λ for each token of a searched batch, by the rule (or `rule`, another of RULES): the
        calibrator's, the prior's (λ_copy where the nearest entry is a copy of the token's context), or
        the constant one."""
        rule, lam = rule or self.name, self.interpolation.lam
        if batch.knn_values is None or batch.knn_dist is None:  # searched: both, or neither
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
        rule, lam = self.name, self.interpolation.lam
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
        assert batch.knn_values is not None and batch.knn_dist is not None  # a searched batch
        prior = None if batch.knn_prior is None else torch.from_numpy(batch.knn_prior)
        lam = row_lam(batch.knn_values, self.lam(batch))
        logp, logw = theta_logprobs(lm_logp, torch.from_numpy(batch.knn_dist), torch.from_numpy(batch.knn_values), prior,
                                    lam, self.interpolation.temperature)
        return logp, lam.numpy(), logw.exp().numpy()
