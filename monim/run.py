"""One run as a library object: a policy (or the bare LM, or a parametric learner) learning a stream
into a work directory, built from its settings (monim.core.run_config.RunConfig). It holds the LM, the feature
store and the memory (or the learner's weights), and learns a day by one recipe (`Run.day`): ingest,
featurize, learn (memorize and calibrate, or train), evaluate, record. The day flow (flows.day) runs the
same steps, each a Prefect task, and registers Θ where the stream is tracked. The benchmarks learn through it.

- Run, the bare LM: learns nothing, predicts with the frozen LM;
- MemoryRun, a memorization policy: memorizes and calibrates each day, predicts with Θ;
- LearnerRun, a parametric learner: trains its weights each day, predicts with that day's weights.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Callable, ContextManager

from monim.core.catalogue import BARE, LEARNER, MEMORY
from monim.core.config import LEARNER_FIELDS
from monim.core.manifest import read_manifest
from monim.core.recency import Recency
from monim.core.run_config import RunConfig
from monim.core.workers import Workers
from monim.data.day import SPLITS, Day
from monim.data.stream import read_day
from monim.evaluation.evaluate import evaluate_many
from monim.evaluation.totals import so_far
from monim.learning.calibration import calibrate as calibrate_memory
from monim.learning.memorize import memorize_day
from monim.learning.parametric import Weights, load_day, train_day, trained_copy
from monim.learning.policies import policy_params, run_policy
from monim.lm.features import Features
from monim.lm.model import LM, cached_lm
from monim.plan import refuse_settings
from monim.storage import forgotten, workdirs
from monim.storage.datastore import Datastore
from monim.storage.fsck import damage
from monim.storage.memory_settings import Settings
from monim.theta.knnlm import RULES
from monim.theta.memory import Memory

Progress = Callable[[int, int], None]  # (tokens done, tokens in all)


def recorded_days(cfg: RunConfig) -> dict[str, dict]:
    """The evaluated days of a run (date -> its row), from earlier processes too."""
    return workdirs.read_rows(cfg.workdir, cfg.name)


class Run:
    """The LM alone, evaluated beside the others: it needs the frozen LM on the test articles only."""

    frozen: bool = True  # predicts with the frozen LM (its scores shared with every run that does)

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits the LM featurizes: the test articles only."""
        return ("test",)

    @cached_property
    def lm(self) -> LM:
        """The frozen LM (loaded once per process, whatever the run)."""
        return cached_lm(self.cfg.model, self.cfg.dtype)

    @cached_property
    def features(self) -> Features:
        """How the run sees documents: the frozen LM's view, through the work directory's feature store."""
        return Features.of(self.cfg, self.lm)

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

    def ingest(self, date: dt.date, since: dt.date | None = None) -> Day:
        """Read the day's news slice, with the records of the days from `since` that hold no article, its
        training articles capped at the run's `max_docs` (the one place the cap applies); an id the
        memory read on another day is a bad record; an article the memory forgot (or a near-duplicate of
        one) is left out, named in the day's `forgotten`."""
        cfg = self.cfg
        day = read_day(cfg.source, date, cfg.seed, cfg.on_error, cfg.fields(), since, workdirs.known_ids(self.root))
        if day is None:
            raise ValueError(f"{cfg.source} has no articles on {date}")
        manifest = read_manifest(self.root / "manifest.json") if (self.root / "manifest.json").exists() else {}
        day = day.without(forgotten.forgotten_docs(manifest), forgotten.fingerprints(manifest))
        return day.capped(cfg.max_docs).truncate(cfg.max_article_tokens, self.lm.cut)

    @property
    def root(self) -> Path:
        """Where the run's memory lies (the bare LM and a learner have none there)."""
        return workdirs.memory_root(self.cfg.workdir, self.cfg.name)

    def featurize(self, day: Day, splits: tuple[str, ...] | None = None,
                  progress: Callable[[str], ContextManager[Progress]] | None = None) -> dict:
        """Run the LM over the day's articles of these splits (default: the run's) that the feature
        store lacks; `progress(description)` gives each split's progress callback."""
        started, tokens = time.perf_counter(), 0
        for split in splits or self.splits:
            with progress(f"LM features {day.date} {split}") if progress else nullcontext() as update:
                tokens += self.features.prepare(day.split(split), f"{day.date}-{split}", update)
        return {"tokens": tokens, "seconds": time.perf_counter() - started}

    def learn(self, day: Day, step: int) -> dict:
        """Learn the day, the stream's `step`-th (memorize and calibrate, or train): the day's row of what it did."""
        return {}

    def predictor(self, date: str | None, recency: Recency = Recency()) -> tuple[LM, Features, Memory | None]:
        """What the run predicts with as of `date` (None: now), its memory read under a recency rule:
        an LM, how it sees documents (the frozen LM's: through the feature store), a memory or None."""
        return self.lm, self.features, None

    def state(self, date: str | None = None) -> str:
        """What the run predicts with as of `date` (None: now), as a short string for cache keys."""
        return BARE

    def evaluate(self, day: Day) -> dict:
        """Test PPL and next-word accuracy of the LM alone and of the run as of the day, on its test articles."""
        lm, features, memory = self.predictor(day.date.isoformat())
        return evaluate_many(lm, day.test, {"run": memory}, features, f"{day.date}-test")["run"]

    def params(self) -> dict:
        """The run's settings as flat parameters (an experiment tracker's): its policy's as it learns
        with them, a learner's or the calibrator's under dotted names."""
        return self.cfg.model_dump(exclude={"delta", "rate", "merge_k", "followed_memrate", "calibrator", "cluster",
                                            *LEARNER_FIELDS})

    def record(self, row: dict) -> None:
        """Record a finished day's row in the memory's manifest and the run's rows (atomically)."""
        workdirs.write_row(self.cfg.workdir, self.cfg.name, row, None if self.memory is None else self.memory.ds)

    def row(self, day: Day, step: int, lm_pass: dict, learned: dict, seconds_learn: float, metrics: dict) -> dict:
        """The day's row: its articles, the LM's pass (`featurize`), what learning did (`learn`) and its seconds,
        the evaluation as of the day (`evaluate`), and the run's totals with the days recorded before it."""
        row = {"date": day.date.isoformat(), "policy": self.cfg.name, "step": step} | {
            f"docs_{k}": v for k, v in day.counts().items()} | {
            "tokens_featurized": lm_pass["tokens"], "seconds_featurize": lm_pass["seconds"],
            "featurize_workers": lm_pass.get("workers", 1)} | learned | {"seconds_learn": seconds_learn} | metrics
        return row | so_far([r for d, r in sorted(recorded_days(self.cfg).items()) if d < row["date"]] + [row])

    def day(self, date: dt.date, step: int = 0, since: dt.date | None = None) -> dict:
        """A run's day, the recipe: ingest, featurize, learn, evaluate and record, in that order; its row.
        `step`: the day's index in the stream; `since`: the first day whose records it counts
        (monim.plan.Plan.since). The day is read once and handed to every step."""
        day = self.ingest(date, since)
        lm_pass = self.featurize(day)
        started = time.perf_counter()  # the day's cost beyond the LM's pass (one per token, shared by every policy)
        with self.writing():  # learned, evaluated and recorded as one: a forget waits for the whole day
            learned = self.learn(day, step)
            seconds_learn = time.perf_counter() - started
            row = self.row(day, step, lm_pass, learned, seconds_learn, self.evaluate(day))
            self.record(row)
        return row


class MemoryRun(Run):
    """A memorization policy: each day memorized and calibrated into one memory, read as Θ."""

    def __init__(self, cfg: RunConfig, settings: Settings | None = None, root: Path | None = None):
        """`settings`, `root`: a study's memory with settings a RunConfig does not name (an index codec,
        calibrator features), in a folder of its own; default: the run's settings and memory folder."""
        super().__init__(cfg)
        self.settings, self._root = settings or Settings.of(cfg), Path(root or workdirs.memory_root(cfg.workdir, cfg.name))
        self._memory: Memory | None = None
        self._workers: Workers | None = None

    @property
    def root(self) -> Path:
        return self._root

    @property
    def calibrates(self) -> bool:
        """Whether a day is calibrated: not where the policy stores no entry (In-Context RALM keeps articles)."""
        return run_policy(self.cfg).stores

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits the LM featurizes: In-Context RALM's learning reads none (the gate and tests read theirs)."""
        return SPLITS if self.calibrates else SPLITS[1:]

    @property
    def memory(self) -> Memory:
        """The run's memory, opened once to learn into with the run's settings (one learned with other
        settings is refused, naming them); opened again where its folder was removed."""
        if self._memory is None or not (self.root / "manifest.json").exists():
            self._memory = Memory(self.root, self.lm, self.settings)
            self._memory.spread_over(self._workers)
        return self._memory

    def spread_over(self, workers: Workers | None) -> None:
        """The memory's searches on `workers` (Memory.spread_over), also where it is opened again (a
        new memory before its first commit); None: in this process."""
        self._workers = workers
        self.memory.spread_over(workers)

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

    def params(self) -> dict:
        return super().params() | {f"policy.{k}": v for k, v in policy_params(run_policy(self.cfg)).items()} | {
            f"calibrator.{k}": v for k, v in asdict(self.cfg.calibrator).items()}

    def relearn(self, date: dt.date) -> None:
        """Let a day the memory holds last, or forgot, be learned again (asked by name); its row goes too."""
        with self.memory.writing():
            self.memory.relearn(date.isoformat())
            workdirs.write_view(self.cfg.workdir, self.cfg.name, self.memory.ds)

    def memorize(self, day: Day, progress: Progress | None = None) -> dict:
        """Score the day with Θ, memorize through the policy, commit atomically (idempotent): what it did."""
        memory = self.memory
        stats = memorize_day(memory, day, run_policy(self.cfg), self.features, self.cfg.seed, progress=progress)
        # the index's health as a metric where its probe measured it (rebuilds, which depend on the process's history, are logged)
        recall = stats.index.get("recall")
        return stats.as_dict() | {"entries": len(memory), "bytes": memory.bytes_on_disk(), "memrate_total": memory.ds.memrate,
                                  "index": {} if recall is None else {"index_recall": recall}}

    def calibrate(self, day: Day) -> dict:
        """Add the day's calibration examples, tune the constant λ, T and train the NN calibrator
        (idempotent per day): Θ's settings after it, and the calibration's summary under "summary"."""
        memory = self.memory
        summary = calibrate_memory(memory, day, self.features)
        interp, rule = memory.interpolation, memory.rule  # just tuned, or as it stood if the day was already calibrated
        out = {"lam": interp.lam, "temperature": interp.temperature, "theta_fallback": int(rule == "lm"),
               "theta_rule": RULES.index(rule)}
        nll = summary.get("nll")  # trained now, or as the day's calibration recorded it
        if nll:
            out |= {"calibration_tokens": summary["calibration_tokens"], "calibration_new_tokens": summary["new_tokens"],
                    "calibrator_seconds": summary["calibrator"]["seconds"], "lam_copy": summary.get("lam_copy", interp.lam)}
            out |= {f"heldout_nll_{r}": nll[r] for r in RULES if nll.get(r) is not None}
            out |= {f"heldout_seen_nll_{r}": v for r, v in (nll.get("seen") or {}).items() if r in RULES and v is not None}
        return out | {"summary": summary}

    @staticmethod
    def learned(stats: dict, theta: dict) -> dict:
        """The day's row from what memorizing (`memorize`) and calibrating (`calibrate`) did."""
        seconds = stats["seconds"]
        pass_seconds = seconds.get("lm_and_search", 0.0) + seconds.get("policy", 0.0)
        decision = {} if stats.get("searched") is None else {  # what the decision searched, and its measured error
            f"decision_{k}": stats[k] for k in ("searched", "settled", "probed", "probe_flipped")}
        return decision | {
            "tokens_seen": stats["tokens_seen"], "entries_stored": stats["stored"], "memrate_day": stats["memrate"],
            "memrate": stats["memrate_total"], "entries": stats["entries"], "memory_bytes": stats["bytes"],
            "tokens_per_s": stats["tokens_seen"] / pass_seconds if pass_seconds else 0.0,
        } | stats["index"] | {k: v for k, v in theta.items() if k != "summary"} | {f"seconds_{k}": v for k, v in seconds.items()}

    def learn(self, day: Day, step: int) -> dict:
        stats = self.memorize(day)
        return self.learned(stats, self.calibrate(day) if self.calibrates else {})

    def predictor(self, date: str | None, recency: Recency = Recency()) -> tuple[LM, Features, Memory | None]:
        memory = self.memory.recent(recency)
        return memory.lm, self.features, memory if date is None else memory.at(date)

    def state(self, date: str | None = None) -> str:
        root = self.root  # read from the manifest: no LM needed
        return Datastore.read(root).checksum(date) if (root / "manifest.json").exists() else "empty"


@functools.lru_cache(maxsize=1)
def _trainable(model: str | None, dtype: str) -> LM:
    """The one copy of the LM whose weights a parametric learner trains or a day's weights are loaded into."""
    return trained_copy(cached_lm(model, dtype))


_LOADED: dict[int, tuple[str, str | None]] = {}  # id(LM) -> (weights folder, day) the trainable copy holds


class LearnerRun(Run):
    """A parametric learner: each day trains the previous day's weights, kept one folder a day."""

    frozen = False

    def lm_at(self, date: str | None) -> LM:
        """The LM as the run's weights stood after `date` (None, or before its first day: the pretrained
        weights), loaded into the process's trainable copy when it holds other weights."""
        lm = _trainable(self.cfg.model, self.cfg.dtype)
        weights = Weights(self.cfg.weights_dir)
        day = None if date is None else weights.as_of(date)
        if _LOADED.get(id(lm)) != (str(weights.root), day):
            _LOADED.pop(id(lm), None)
            load_day(lm, weights, day, self.lm)
            _LOADED[id(lm)] = (str(weights.root), day)
        return lm

    def train(self, day: Day, index: int) -> dict:
        """Train the previous day's weights on the day's training articles (the stream's `index`-th day,
        for Mix-Review's decay) and commit them (a trained day is kept as it is): the day's weights' record."""
        weights, date = Weights(self.cfg.weights_dir), day.date.isoformat()
        if date in weights.days():
            return weights.meta(date) | {"already": True}
        learner = self.cfg.learner()
        previous = weights.latest(before=date)
        lm = self.lm_at(previous)
        pretrained = self.lm.model.state_dict() if learner.method == "recadam" else None
        optimizer_step = weights.meta(previous)["step"] if previous else 0
        _LOADED.pop(id(lm), None)  # its weights change now: reloaded at the next lm_at if training fails
        stats = train_day(lm, day.train, learner, index, optimizer_step, pretrained)
        weights.save(date, lm.model, stats | {"date": date, "from": previous})
        _LOADED[id(lm)] = (str(weights.root), date)
        return weights.meta(date)

    def params(self) -> dict:
        return super().params() | {f"learner.{k}": v for k, v in asdict(self.cfg.learner()).items()}

    def trained(self, meta: dict) -> dict:
        """The day's row from what training did."""
        return {k: meta[k] for k in ("tokens_trained", "review_tokens", "steps", "train_loss")} | {
            "tokens_seen": meta["tokens_trained"], "memory_bytes": Weights(self.cfg.weights_dir).bytes_on_disk()}

    def learn(self, day: Day, step: int) -> dict:
        return self.trained(self.train(day, step))

    def predictor(self, date: str | None, recency: Recency = Recency()) -> tuple[LM, Features, Memory | None]:
        lm = self.lm_at(date)
        return lm, Features(lm, self.cfg.window()), None  # scored live: no other run shares these weights

    def state(self, date: str | None = None) -> str:
        weights = Weights(self.cfg.weights_dir)
        day = weights.latest() if date is None else weights.as_of(date)
        meta = weights.meta(day) if day else {}
        return f"w-{day}-{hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest()[:12]}"

    def evaluate(self, day: Day) -> dict:
        """The LM alone stays the pretrained LM's, as for every run; Θ is the day's weights."""
        frozen = Run(self.cfg).evaluate(day)
        trained = super().evaluate(day)
        return frozen | {k: trained[k] for k in ("ppl", "accuracy", "ppl_novel")}


KINDS = {BARE: Run, MEMORY: MemoryRun, LEARNER: LearnerRun}


def make_run(cfg: RunConfig, **study) -> Run:
    """The run of a config's kind (`study`: MemoryRun's settings and root, for a memory run)."""
    return KINDS[cfg.kind](cfg, **study)


_OPEN: dict[tuple[str, str], Run] = {}  # (work directory, run name) -> the run open in this process
_OPENING = threading.Lock()  # a task runner's threads ask for the same run at once


def open_run(cfg: RunConfig) -> Run:
    """The run `cfg` names, open once per process (its memory and LM stay loaded from day to day of a
    stream); opened again when its settings change."""
    key = (str(Path(cfg.workdir).resolve()), cfg.name)
    with _OPENING:
        if key not in _OPEN or _OPEN[key].cfg != cfg:
            _OPEN[key] = make_run(cfg)
        return _OPEN[key]


def refuse_others(cfg: RunConfig, policies: list[str]) -> None:
    """Refuse, before any work, a work directory whose memories another model learned (one model per
    work directory), or a policy's memory another model, other weights or other settings learned
    (Memory refuses it, naming the fields); the runs stay open for the work that follows."""
    refuse_settings(cfg, policies)
    for policy in policies:
        open_run(cfg.model_copy(update={"policy": policy})).memory