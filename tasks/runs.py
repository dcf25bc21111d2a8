"""The three kinds of run, one strategy each: how it learns a day, what it predicts with as of a day,
how it is evaluated, what its state is (for caches and the registry) and what it registers.

- the bare LM: learns nothing, predicts with the frozen LM;
- a memory (a memorization policy): memorizes and calibrates each day, predicts with Θ;
- a parametric learner: trains its weights each day, predicts with that day's weights.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from typing import ContextManager

from prefect import task

from monim.catalogue import BARE, LEARNER
from monim.config import RunConfig
from monim.datastore import Datastore
from monim.evaluate import evaluate_many
from monim.features import Features
from monim.fsck import damage
from monim.lm import LM, cached_lm
from monim.memory import Memory
from monim.parametric import Weights
from monim.recency import Recency
from monim.stream import SPLITS, Day
from tasks.learning import calibrate, features_for, lm_at, logger, memorize, memory_for, train


class BareRun:
    """The LM alone, evaluated beside the others: it needs the frozen LM on the test articles only."""

    splits: tuple[str, ...] = ("test",)

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    @property
    def memory(self) -> Memory | None:
        return None

    def open(self) -> None:
        """Open what the run learns into, before any work: refused where another model, other weights
        or other settings learned it, or where it fails its checks."""

    def writing(self) -> ContextManager:
        """Held while a day is learned, evaluated and recorded: a writer of the same memory (a forget)
        waits for the whole day, so the day's readers never meet a shard it replaced."""
        return nullcontext()

    def learn(self, day: Day, step: int) -> dict:
        """Learn the day (memorize and calibrate, or train); the day's row of what it did."""
        return {}

    def predictor(self, date: str | None, recency: Recency = Recency()) -> tuple[LM, Features, Memory | None]:
        """What the run predicts with as of `date` (None: now), its memory read under a recency rule:
        an LM, how it sees documents (the frozen LM's: through the feature store), a memory or None."""
        return cached_lm(self.cfg.model, self.cfg.dtype), features_for(self.cfg), None

    def state(self, date: str | None = None) -> str:
        """What the run predicts with as of `date` (None: now), as a short string for cache keys."""
        return BARE

    def evaluate(self, day: Day) -> dict:
        """Test PPL and next-word accuracy of the LM alone and of the run as of the day, on its test articles."""
        lm, features, memory = self.predictor(day.date.isoformat())
        return evaluate_many(lm, day.test, {"run": memory}, features, f"{day.date}-test")["run"]

    def register(self, day: Day, run_id: str, uri: str) -> dict:
        """Register what the run predicts with as of the day (a memory's Θ) in the model registry."""
        return {}


class MemoryRun(BareRun):
    """A memorization policy: each day memorized and calibrated into one memory, read as Θ."""

    splits = SPLITS

    @property
    def memory(self) -> Memory:
        return memory_for(self.cfg)

    def open(self) -> None:
        memory = self.memory  # another model, weights or settings: refused here (MemoryMismatch, SettingsMismatch)
        if not memory.ds.days:
            return
        with memory.writing():
            problems = [p for p in damage(memory.ds.root) if not p.repaired]
        if problems:
            raise ValueError(f"{memory.ds.root} fails its checks, so no day is added to it: {problems[0].where}: "
                             f"{problems[0].what}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                             + f"; `monim fsck --workdir {self.cfg.workdir}` lists them, `--repair` mends what can be")

    def writing(self) -> ContextManager:
        return self.memory.writing()

    def learn(self, day: Day, step: int) -> dict:
        memory = self.memory
        stats = memorize(self.cfg, day, memory)
        theta = calibrate(self.cfg, day, memory)
        seconds = stats.pop("seconds")
        pass_seconds = seconds.get("lm_and_search", 0.0) + seconds.get("policy", 0.0)
        return {
            "tokens_seen": stats["tokens_seen"], "entries_stored": stats["stored"], "memrate_day": stats["memrate"],
            "memrate": stats["memrate_total"], "entries": stats["entries"], "memory_bytes": stats["bytes"],
            "tokens_per_s": stats["tokens_seen"] / pass_seconds if pass_seconds else 0.0,
        } | stats["index"] | theta | {f"seconds_{k}": v for k, v in seconds.items()}

    def predictor(self, date: str | None, recency: Recency = Recency()) -> tuple[LM, Features, Memory | None]:
        memory = self.memory.recent(recency)
        return memory.lm, features_for(self.cfg), memory if date is None else memory.at(date)

    def state(self, date: str | None = None) -> str:
        root = self.cfg.memory_dir  # read from the manifest: no LM needed
        return Datastore.read(root).checksum(date) if (root / "manifest.json").exists() else "empty"

    def register(self, day: Day, run_id: str, uri: str) -> dict:
        from tasks.registry import register_day  # MLflow's model registry: only where a run is logged

        return register_day(self.cfg, day, self.memory.at(day.date.isoformat()), run_id, uri)


class LearnerRun(BareRun):
    """A parametric learner: each day trains the previous day's weights, kept one folder a day."""

    def learn(self, day: Day, step: int) -> dict:
        trained = train(self.cfg, day, step)
        return {k: trained[k] for k in ("tokens_trained", "review_tokens", "steps", "train_loss")} | {
            "tokens_seen": trained["tokens_trained"], "memory_bytes": Weights(self.cfg.weights_dir).bytes_on_disk()}

    def predictor(self, date: str | None, recency: Recency = Recency()) -> tuple[LM, Features, Memory | None]:
        lm = lm_at(self.cfg, date)
        return lm, Features(lm, self.cfg.window()), None  # scored live: no other run shares these weights

    def state(self, date: str | None = None) -> str:
        weights = Weights(self.cfg.weights_dir)
        day = weights.latest() if date is None else weights.as_of(date)
        meta = weights.meta(day) if day else {}
        return f"w-{day}-{hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest()[:12]}"

    def evaluate(self, day: Day) -> dict:
        """The LM alone stays the pretrained LM's, as for every run; Θ is the day's weights."""
        frozen = BareRun(self.cfg).evaluate(day)
        trained = super().evaluate(day)
        return frozen | {k: trained[k] for k in ("ppl", "accuracy", "ppl_novel")}


KINDS = {BARE: BareRun, LEARNER: LearnerRun}


def run_for(cfg: RunConfig) -> BareRun:
    """The strategy of a run's kind."""
    return KINDS.get(cfg.kind, MemoryRun)(cfg)


def _evaluation_key(context, parameters: dict) -> str:
    """Cache key: the day, the run's settings (the LM's dtype as "auto" resolved it on this machine)
    and the state of what the run predicts with, never tensors."""
    cfg = parameters["cfg"]
    dtype = cached_lm(cfg.model, cfg.dtype).dtype
    return f"monim-eval-{cfg.fingerprint()}-{dtype}-{parameters['date']}-{parameters['state']}"


@task(cache_key_fn=_evaluation_key, persist_result=True)
def evaluate(cfg: RunConfig, date: str, state: str, day: Day) -> dict:
    """Test PPL and next-word accuracy of the LM alone and of the run as of the day (its `state`),
    on the day's test articles."""
    started = time.perf_counter()
    metrics = run_for(cfg).evaluate(day)
    logger().info("%s %s: test PPL %.2f (LM alone %.2f), accuracy %.3f", cfg.name, date, metrics["ppl"],
                  metrics["ppl_lm"], metrics["accuracy"])
    return metrics | {"evaluate_seconds": time.perf_counter() - started}
