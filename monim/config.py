"""RunConfig: everything one learning run depends on, as one typed spec (a pydantic model: Prefect
validates it and renders it as a form; JSON in and out)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, fields
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from monim import catalogue
from monim.calibrator import CalibratorConfig
from monim.catalogue import LEARNER, MEMORY
from monim.features import Features
from monim.index import IndexConfig
from monim.lm import DTYPE_CHOICES, LM
from monim.parametric import Learner
from monim.policies import Policy, policy_params
from monim.workdirs import memory_root
from monim.scoring import CONTEXT_MODES, ScoreConfig
from monim.sources import Fields
from monim.stream import DEMO_STREAM
from monim.settings import PolicyConfig, Settings


_LEARNER = Learner()  # the parametric learners' defaults, read once for the fields below
LEARNER_FIELDS = tuple(f.name for f in fields(Learner) if f.name not in ("method", "seed"))


class RunConfig(BaseModel):
    """One policy learning one stream into a work directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(str(DEMO_STREAM), description="News stream: a JSONL/News Crawl file, a folder of per-day files, or hf:NAME.")
    workdir: str = Field("monim-work", description="Work directory: memories, feature store, run records, MLflow database.")
    policy: str = Field("monim-amt", description=catalogue.help_text())
    delta: float = Field(-1.5, lt=0, description="MoNIM's δ: a token is stored when log P(token) under Θ is below δ "
                         "(monim), or below δ / (margin + 0.5) under the adaptive threshold (monim-amt).")
    rate: float | None = Field(None, gt=0, le=1, description="RandMem's and KL's share of tokens stored; empty: "
                               "RandMem at MoNIM's MemRate when a comparison runs both, else 0.5.")
    merge_k: int = Field(9, ge=1, description="Greedy Merging: neighbours searched for same-value entries to merge.")
    followed_memrate: float | None = Field(None, ge=0, le=1, description="Set by a comparison: the MemRate of the run "
                                           "this one follows (RandMem stores at MoNIM's), where `rate` is empty.")
    model: str | None = Field(None, description="The LM: a hub name or local path; empty: the bundled SmolLM2-135M GGUF.")
    max_docs: int | None = Field(None, ge=1, description="Training articles taken per day (the first ones); empty: all.")
    max_article_tokens: int | None = Field(16384, ge=2, description="Articles longer than this many tokens are cut to "
                                           "them (counted in the day's docs_truncated); empty: no cap.")
    on_error: Literal["raise", "skip"] = Field("raise", description="A bad record (a broken line, a missing field, an id "
                                               "met twice, a date after today): raise, or skip it (counted in the day's "
                                               "docs_skipped).")
    missing_id: Literal["error", "hash"] = Field("error", description="A record without an id: an error, or named by a "
                                                 "hash of its date and text.")
    max_feed_lag: int = Field(1, ge=0, description="The daily run fails (monim.stream.FeedStalled) when the feed's last "
                              "article is dated more than this many days before yesterday, the day it should learn.")
    seed: int = 0
    calibrated: bool = Field(True, description="Θ uses the NN calibrator's per-token λ (off: the constant λ).")
    calibrator_params: dict = Field(default_factory=dict, description="monim.calibrator.CalibratorConfig fields.")
    stride: int = Field(512, ge=1, description="Tokens scored per window.")
    context: int = Field(512, ge=0, description="Tokens of left context per window.")
    context_mode: Literal[CONTEXT_MODES] = Field("carry", description="carry (KV cache of the previous window), document or recompute.")
    batch_size: int | None = Field(None, ge=1, description="Rows of up to stride + context tokens per forward "
                                   "pass; empty: 8 on a CPU, 64 on a GPU.")
    dtype: Literal[DTYPE_CHOICES] = Field("auto", description="The LM's weights: float32, bfloat16 or float16; auto: bfloat16 on a GPU, "
                       "float32 on a CPU (where bfloat16 runs ~2x slower).")
    feature_store: bool = Field(True, description="Keep the LM's features in <workdir>/features (every policy reads them).")
    feature_cap_gb: float = Field(50.0, gt=0, description="The feature store's size cap (oldest folders go first).")
    cluster: str | None = Field(None, description="Address of a Dask scheduler (tcp://host:8786) whose workers run the "
                                "LM over each day's articles into the feature store; empty: this process.")
    lr: float = Field(_LEARNER.lr, gt=0, description="Parametric learners: Adam's learning rate.")
    train_tokens: int | None = Field(_LEARNER.train_tokens, ge=1, description="Parametric learners: training tokens a "
                                     "day, first articles first; empty: all.")
    train_block: int = Field(_LEARNER.train_block, ge=2, description="Parametric learners: tokens per training sequence.")
    train_batch: int = Field(_LEARNER.train_batch, ge=1, description="Parametric learners: sequences per optimizer step.")
    epochs: int = Field(_LEARNER.epochs, ge=1, description="Parametric learners: passes over each day's tokens.")
    review: str | None = Field(_LEARNER.review, description="Mix-Review: the general-domain text (a plain text file).")
    review_from: int = Field(_LEARNER.review_from, ge=0, description="Mix-Review: characters of the review text skipped "
                             "(a forgetting probe may read its start).")
    mix_ratio: float = Field(_LEARNER.mix_ratio, ge=0, description="Mix-Review: general-domain tokens per new token on "
                             "the first day.")
    mix_decay: float = Field(_LEARNER.mix_decay, ge=0, le=1, description="Mix-Review: the ratio's decay a day.")
    pretrain_coef: float = Field(_LEARNER.pretrain_coef, ge=0, description="RecAdam: γ, the pull toward the pretrained weights.")
    anneal_k: float = Field(_LEARNER.anneal_k, description="RecAdam: the annealing rate k.")
    anneal_t0: int = Field(_LEARNER.anneal_t0, description="RecAdam: the annealing midpoint t0, in steps.")
    k: int = Field(1024, ge=1, description="Neighbours retrieved per token.")
    nprobe: int = Field(32, ge=1, description="IVF lists searched once the index is approximate.")
    exact_below: int = Field(200_000, ge=0, description="Entries below which the index searches exactly.")

    @model_validator(mode="after")
    def _known_policy(self) -> RunConfig:
        kind = catalogue.entry(self.policy).kind  # a clear error naming the policies
        try:
            if kind == LEARNER:
                self.learner()
            elif kind == MEMORY:
                self.make_policy()
        except TypeError as e:
            raise ValueError(f"{self.policy}: {e}") from None
        if self.cluster and not self.feature_store:
            raise ValueError("cluster needs the feature store: the workers write the LM's features there")
        try:
            self.settings()
        except TypeError as e:
            raise ValueError(f"calibrator_params: {e}") from None
        return self

    @property
    def kind(self) -> str:
        """bare (the LM alone), memory (a memorization policy) or learner (a parametric learner)."""
        return catalogue.entry(self.policy).kind

    @property
    def name(self) -> str:
        """The run's name: the policy ('-const' when Θ uses the constant λ), or 'bare' for the LM alone."""
        return self.policy if self.calibrated or self.kind != MEMORY else f"{self.policy}-const"

    @property
    def weights_dir(self) -> Path:
        """Where a parametric learner keeps each day's weights."""
        return Path(self.workdir) / "weights" / self.name

    def learner(self) -> Learner:
        return Learner(method=self.policy, seed=self.seed, **{f: getattr(self, f) for f in LEARNER_FIELDS})

    @property
    def memory_dir(self) -> Path:
        return memory_root(self.workdir, self.name)

    def fields(self) -> Fields:
        """How the source's records are read."""
        return Fields(missing_id=self.missing_id)

    def policy_config(self) -> PolicyConfig:
        """The parameters the run's policy reads (the others at their defaults): what its memory records."""
        return PolicyConfig(**{f: getattr(self, f) for f in catalogue.entry(self.policy).reads})

    def make_policy(self) -> Policy:
        return catalogue.make_policy(self.policy, self.policy_config(), self.followed_memrate)

    def window(self) -> ScoreConfig:
        return ScoreConfig(stride=self.stride, context=self.context, batch_size=self.batch_size,
                           context_mode=self.context_mode)

    def settings(self) -> Settings:
        """What Θ is read with (monim.settings): a memory records these at its first commit."""
        return Settings(self.dtype, self.calibrated, self.window(),
                        IndexConfig(k=self.k, nprobe=self.nprobe, exact_below=self.exact_below),
                        CalibratorConfig(**self.calibrator_params), policy=self.policy_config())

    def features(self, lm: LM) -> Features:
        """How this run gets the LM's view of documents: from the work directory's feature store, or the LM."""
        store = Path(self.workdir) / "features" if self.feature_store else None
        return Features(lm, self.window(), store, int(self.feature_cap_gb * 2**30))

    def params(self) -> dict:
        """Flat parameters for an experiment tracker."""
        out = self.model_dump(exclude={"delta", "rate", "merge_k", "followed_memrate", "calibrator_params", "cluster",
                                       *LEARNER_FIELDS})
        if self.kind == LEARNER:
            out |= {f"learner.{k}": v for k, v in asdict(self.learner()).items()}
        elif self.kind == MEMORY:
            out |= {f"policy.{k}": v for k, v in policy_params(self.make_policy()).items()}
            out |= {f"calibrator.{k}": v for k, v in asdict(self.settings().calibrator).items()}
        return out

    def fingerprint(self) -> str:
        """A short hash of the settings that change results (for cache keys)."""
        ignored = {"cluster", "max_feed_lag"}  # where the LM runs, when the daily run fails: no result changes
        if self.kind != LEARNER:
            ignored |= set(LEARNER_FIELDS)  # memory runs ignore the learners' settings
        return hashlib.sha256(self.model_dump_json(exclude=ignored).encode()).hexdigest()[:12]
