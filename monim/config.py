"""RunConfig: everything one learning run depends on, as a plain dataclass (JSON in and out)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from monim.calibrator import CalibratorConfig
from monim.features import Features
from monim.index import IndexConfig
from monim.lm import LM
from monim.scoring import ScoreConfig
from monim.policies import Policy, make_policy, policy_params
from monim.stream import DEMO_STREAM

BARE = "bare"  # the LM without memory, evaluated alongside the policies


@dataclass
class RunConfig:
    """One policy learning one stream into a work directory."""

    source: str = str(DEMO_STREAM)
    workdir: str = "monim-work"
    policy: str = "monim-amt"
    policy_params: dict = field(default_factory=dict)
    model: str | None = None
    max_docs: int | None = None  # training documents taken per day
    seed: int = 0
    calibrated: bool = True  # Θ uses the NN calibrator's per-token λ (False: the constant λ)
    calibrator_params: dict = field(default_factory=dict)  # monim.calibrator.CalibratorConfig fields
    stride: int = 512
    context: int = 512
    context_mode: str = "carry"  # monim.scoring.CONTEXT_MODES
    batch_size: int = 8
    feature_store: bool = True  # keep the LM's features in <workdir>/features (every policy reads them)
    feature_cap_gb: float = 50.0  # the feature store's size cap (oldest folders go first)
    k: int = 1024
    nprobe: int = 32
    exact_below: int = 200_000

    @property
    def name(self) -> str:
        """The run's name: the policy ('-const' when Θ uses the constant λ), or 'bare' for the LM alone."""
        return self.policy if self.calibrated or self.policy == BARE else f"{self.policy}-const"

    @property
    def memory_dir(self) -> Path:
        return Path(self.workdir) / "memories" / self.name

    def make_policy(self) -> Policy:
        return make_policy(self.policy, **self.policy_params)

    def score_config(self) -> ScoreConfig:
        return ScoreConfig(stride=self.stride, context=self.context, batch_size=self.batch_size,
                           context_mode=self.context_mode)

    def features(self, lm: LM) -> Features:
        """How this run gets the LM's view of documents: from the work directory's feature store, or the LM."""
        store = Path(self.workdir) / "features" if self.feature_store else None
        return Features(lm, self.score_config(), store, int(self.feature_cap_gb * 2**30))

    def calibrator_config(self) -> CalibratorConfig:
        return CalibratorConfig(**self.calibrator_params)

    def index_config(self) -> IndexConfig:
        return IndexConfig(k=self.k, nprobe=self.nprobe, exact_below=self.exact_below)

    def params(self) -> dict:
        """Flat parameters for an experiment tracker."""
        out = {k: v for k, v in asdict(self).items() if k not in ("policy_params", "calibrator_params")}
        if self.policy != BARE:
            out |= {f"policy.{k}": v for k, v in policy_params(self.make_policy()).items()}
            out |= {f"calibrator.{k}": v for k, v in asdict(self.calibrator_config()).items()}
        return out

    def fingerprint(self) -> str:
        """A short hash of the settings that change results (for cache keys)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:12]
