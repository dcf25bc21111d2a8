"""A run's settings (RunConfig): one policy learning one stream, every field named, typed and described
(pydantic: a form in the Prefect UI, one option each on the command line). Apart from monim.core.config,
whose plain dataclasses the LM, Θ and the GPU bench read without pydantic."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from monim.core import catalogue
from monim.core.catalogue import LEARNER, MEMORY
from monim.core.config import (
    DEMO_STREAM,
    LEARNER_FIELDS,
    PROBE_EVERY,
    SEEN_CONTEXT,
    CalibratorConfig,
    ContextMode,
    Dtype,
    Fields,
    IndexConfig,
    Learner,
    PolicyConfig,
    ScoreConfig,
)

_LEARNER, _POLICY, _INDEX, _FIELDS = Learner(), PolicyConfig(), IndexConfig(), Fields()  # the defaults of the fields below


class RunConfig(BaseModel):
    """One policy learning one stream into a work directory."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a non-finite δ or rate means nothing

    source: str = Field(str(DEMO_STREAM), description="News stream: a JSON Lines file (an article a line: id, "
                        "date, text, title), a News Crawl file, a folder of per-day files, or hf:NAME (a `datasets` dataset).")
    workdir: str = Field("monim-work", description="Work directory: memories, feature store, runs' rows, MLflow database.")
    policy: str = Field("monim-amt", description=catalogue.help_text())
    delta: float = Field(_POLICY.delta, lt=0, description="MoNIM's δ: a token is stored when log P(token) under Θ is below δ "
                         "(monim), or below δ / (margin + 0.5) under the adaptive threshold (monim-amt).")
    rate: float | None = Field(_POLICY.rate, gt=0, le=1, description="RandMem's and KL's share of tokens stored; empty: "
                               "RandMem at MoNIM's MemRate when a comparison runs both, else 0.5.")
    merge_k: int = Field(_POLICY.merge_k, ge=1, description="Greedy Merging: neighbours searched for same-value entries to merge.")
    search_margin: float | None = Field(_POLICY.search_margin, ge=0, description="MoNIM: a training token the LM alone "
                                        "keeps out of memory by more than this slack (g(L, M) - δ) is not searched for "
                                        f"the decision, one in {PROBE_EVERY} of them searched anyway to measure the error; empty: "
                                        "every token the memory could flip is searched.")
    search_context: bool = Field(_POLICY.search_context, description="MoNIM: a training token the LM alone would store "
                                 f"is searched for the decision only where the memorized text holds its last {SEEN_CONTEXT} "
                                 f"tokens, one in {PROBE_EVERY} of the others searched anyway to measure the error; off: "
                                 "every such token is searched.")
    ralm_stride: int = Field(32, ge=1, description="In-Context RALM (ralm, ralm+monim-amt): tokens scored after each "
                             "retrieved article (4, 8, 16 or 32; fewer: closer to the text, one LM pass each).")
    ralm_query: int = Field(_POLICY.ralm_query, ge=1, description="In-Context RALM: the last tokens before a stride "
                            "that retrieve its article.")
    followed_memrate: float | None = Field(None, ge=0, le=1, description="Set by a comparison: the MemRate of the run "
                                           "this one follows (RandMem stores at MoNIM's), where `rate` is empty.")
    model: str | None = Field(None, description="The LM: a hub name or local path; empty: the bundled SmolLM2-135M GGUF.")
    max_docs: int | None = Field(None, ge=1, description="Training articles taken per day (the first ones); empty: all.")
    max_article_tokens: int | None = Field(16384, ge=2, description="Articles longer than this many tokens are cut to "
                                           "them (counted in the day's docs_truncated); empty: no cap.")
    on_error: Literal["raise", "skip"] = Field("raise", description="A bad record (a broken line, a missing field, an id "
                                               "met twice, a date after today): raise, or skip it (counted in the day's "
                                               "docs_skipped).")
    date_field: str = Field(_FIELDS.date, min_length=1, description="The record's field that holds an article's date "
                            "(YYYY-MM-DD, YYYYMMDD or an ISO timestamp): JSON Lines and `datasets` sources.")
    text_field: str = Field(_FIELDS.text, min_length=1, description="The record's field that holds an article's text.")
    id_field: str = Field(_FIELDS.id, min_length=1, description="The record's field that holds an article's id (a "
                          "string or an integer).")
    title_field: str = Field(_FIELDS.title, min_length=1, description="The record's field that holds an article's "
                             "headline (optional in a record; shown as a source of generated text).")
    missing_id: Literal["error", "hash"] = Field(_FIELDS.missing_id, description="A record without an id: an error, or "
                                                 "named by a hash of its date and text.")
    max_feed_lag: int = Field(1, ge=0, description="The daily run fails (monim.data.stream.FeedStalled) when the feed's last "
                              "article is dated more than this many days before yesterday, the day it should learn.")
    seed: int = Field(0, ge=0, description="Seed of the run's random draws: RandMem's tokens, calibration samples, a learner's batches.")
    calibrated: bool = Field(True, description="Θ uses the NN calibrator's per-token λ (off: the constant λ).")
    calibrator: CalibratorConfig = Field(default_factory=CalibratorConfig, description="How the NN calibrator is "
                                         "trained and used (CalibratorConfig's fields).")
    stride: int = Field(512, ge=1, description="Tokens scored per window.")
    context: int = Field(512, ge=0, description="Tokens of left context per window.")
    context_mode: ContextMode = Field("carry", description="carry (KV cache of the previous window), document or recompute.")
    batch_size: int | None = Field(None, ge=1, description="Rows of up to stride + context tokens per forward "
                                   "pass; empty: 8 on a CPU, 128 on a GPU.")
    dtype: Dtype = Field("auto", description="The LM's weights: float32, bfloat16 or float16; auto: bfloat16 on a GPU, "
                       "float32 on a CPU (where bfloat16 runs ~2x slower).")
    feature_store: bool = Field(True, description="Keep the LM's features in <workdir>/features (every policy reads them).")
    feature_cap_gb: float = Field(50.0, gt=0, description="The feature store's size cap (oldest folders go first).")
    cluster: str | None = Field(None, description="Address of a Dask scheduler (tcp://host:8786) whose workers run the "
                                "LM pass and the memory's searches (the commit stays in this process); empty: this process.")
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
    k: int = Field(_INDEX.k, ge=1, description="Neighbours retrieved per token.")
    nprobe: int = Field(_INDEX.nprobe, ge=1, description="IVF lists searched once the index is approximate.")
    exact_below: int = Field(_INDEX.exact_below, ge=0, description="Entries below which the index searches exactly "
                             "(fewer for a policy whose decision searches the memory: monim.storage.index.exact_limit).")
    part_bytes: int | None = Field(_INDEX.part_bytes, ge=1, description="The most bytes of index one part of the "
                                   "memory holds (one worker's budget: fp32 keys while exact, codes once IVF-PQ): past "
                                   "it the memory's days are split by day range into parts, searched apart and their "
                                   "top-k merged (on the cluster's workers with --cluster); empty: one index.")

    @model_validator(mode="after")
    def _known_policy(self) -> RunConfig:
        if catalogue.policy_info(self.policy).kind == LEARNER:  # a clear error naming the policies
            try:
                self.learner()
            except TypeError as e:
                raise ValueError(f"{self.policy}: {e}") from None
        if len({self.date_field, self.text_field, self.id_field, self.title_field}) < 4:
            raise ValueError("date_field, text_field, id_field and title_field must name four different fields")
        if self.cluster and not self.feature_store:
            raise ValueError("cluster needs the feature store: the workers write the LM's features there")
        return self

    @property
    def kind(self) -> str:
        """bare (the LM alone), memory (a memorization policy) or learner (a parametric learner)."""
        return catalogue.policy_info(self.policy).kind

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

    def fields(self) -> Fields:
        """How the source's records are read."""
        return Fields(self.date_field, self.text_field, self.id_field, self.title_field, self.missing_id)

    def policy_config(self) -> PolicyConfig:
        """The parameters the run's policy reads (the others at their defaults): what its memory records."""
        return PolicyConfig(**{f: getattr(self, f) for f in catalogue.policy_info(self.policy).reads})

    def window(self) -> ScoreConfig:
        return ScoreConfig(stride=self.stride, context=self.context, batch_size=self.batch_size,
                           context_mode=self.context_mode)

    def index(self) -> IndexConfig:
        return IndexConfig(k=self.k, nprobe=self.nprobe, exact_below=self.exact_below, part_bytes=self.part_bytes)

    def fingerprint(self) -> str:
        """A short hash of the settings that change results (for cache keys)."""
        ignored = {"cluster", "max_feed_lag"}  # where the LM runs, when the daily run fails: no result changes
        if self.kind != LEARNER:
            ignored |= set(LEARNER_FIELDS)  # memory runs ignore the learners' settings
        return hashlib.sha256(self.model_dump_json(exclude=ignored).encode()).hexdigest()[:12]
