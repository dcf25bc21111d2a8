"""Calibration: what Θ's calibrator and constant (λ, T) learn from each day, and the LM fallback.

Tomorrow's test articles meet the memory as it stands after today, and none of their text is in it
(a near-duplicate group never spans two splits). Calibration examples are drawn to look like that,
by `CalibratorConfig.source`:
- "train" (default): a sample of the day's training articles, searched in today's memory with the
  entries of their own near-duplicate group left out (the datastore's provenance makes that an id
  filter);
- "yesterday": the same sample searched in the memory as it stood before today (blind to
  same-day twins);
- "validation": the day's validation articles (the paper's scheme; a third held back by id).
The sample's LM features are kept while the day is memorized (`Sample`), so no LM pass is repeated.
The day's validation articles are searched in today's memory and held out: early stopping, and
the fallback, where a day whose Θ scores worse than the LM on them uses the LM alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from monim.core.atomic import checksum, replacing, write_json
from monim.data.day import Day
from monim.data.feed import Document
from monim.lm.features import Features
from monim.lm.token_scores import TokenScores
from monim.storage.datastore import Datastore
from monim.storage.memory_settings import Settings
from monim.theta.calibrator import (
    LAM_CEIL,
    Calibrator,
    CalibratorConfig,
    Examples,
    examples,
    train_calibrator,
    warm_epochs,
)
from monim.theta.knnlm import (
    TEMPERATURES,
    Interpolation,
    choose_rule,
    copies,
    interpolate,
    knn_logprobs_by_temperature,
    prior_lam,
    tune_grid,
)

if TYPE_CHECKING:
    from monim.theta.memory import Memory

LM_FIELDS = ("doc_id", "position", "prev", "target", "logp", "max_logp", "entropy", "argmax", "key")


def _rank(seed: int, doc_id: str) -> bytes:
    return hashlib.sha256(f"calibration:{seed}:{doc_id}".encode()).digest()


def sample_documents(docs: list[Document], lengths: list[int], budget: int, seed: int = 0) -> set[str]:
    """Ids of training articles (in a seeded order) whose tokens fill the day's sample budget."""
    chosen, total = set(), 0
    for i in sorted(range(len(docs)), key=lambda i: _rank(seed, docs[i].id)):
        if total >= budget:
            break
        chosen.add(docs[i].id)
        total += lengths[i]
    return chosen


def sample_budget(ccfg: CalibratorConfig, day_tokens: int) -> int:
    """Training tokens the day's sample takes: a share of what the day offers, at least the floor, at most
    `sample_tokens` (none for the paper's scheme)."""
    if ccfg.source == "validation":
        return 0
    return min(ccfg.sample_tokens, max(ccfg.sample_floor, round(ccfg.sample_share * day_tokens)))


class Sample:
    """The LM features of a day's sampled training tokens, gathered while the day is memorized."""

    def __init__(self, doc_ids: set[str], budget: int):
        self.doc_ids, self.budget, self.n = doc_ids, budget, 0
        self.parts: list[TokenScores] = []

    @classmethod
    def of(cls, docs: list[Document], lengths: list[int], ccfg: CalibratorConfig) -> Sample:
        """The day's sample as the calibration settings ask (none for the paper's scheme)."""
        budget = sample_budget(ccfg, sum(lengths))
        return cls(sample_documents(docs, lengths, budget, ccfg.seed), budget)

    def add(self, batch: TokenScores) -> None:
        rows = np.flatnonzero(np.isin(batch.doc_id, list(self.doc_ids)))[: max(0, self.budget - self.n)]
        if len(rows):
            self.parts.append(TokenScores(**{f: getattr(batch, f)[rows] for f in LM_FIELDS}))
            self.n += len(rows)

    def save(self, path: Path) -> None:
        """Write the sample aside and rename it into place (before the day is committed)."""
        if not self.parts:
            return
        batch = TokenScores.concat(self.parts)
        with replacing(path) as tmp:
            np.savez(tmp, **{f: getattr(batch, f).astype(str) if f == "doc_id" else getattr(batch, f) for f in LM_FIELDS})

    @staticmethod
    def load(path: Path) -> TokenScores:
        with np.load(path) as f:
            return TokenScores(**{k: f[k].astype(object) if k == "doc_id" else f[k] for k in LM_FIELDS})


def sample_path(memory: Memory, date: str) -> Path:
    return memory.ds.root / "calibration" / f"{date}.npz"


def day_sample(memory: Memory, day: Day, features: Features | None) -> TokenScores | None:
    """The day's sample kept by memorization, or (a day memorized without one) scored again."""
    path = sample_path(memory, day.date.isoformat())
    if path.exists():
        return Sample.load(path)
    features = features or memory.features()
    sample = Sample.of(day.train, [len(t) for t in features.tokenize(day.train)], memory.calibrator_cfg)
    for batch in features.scores([d for d in day.train if d.id in sample.doc_ids], f"{day.date}-train"):
        sample.add(batch)
    return TokenScores.concat(sample.parts) if sample.parts else None


def sample_examples(memory: Memory, sample: TokenScores, day: Day, leave_out: str) -> Examples:
    """Calibration examples from the sample, searched in the memory after the day without the
    entries of each article's near-duplicate group ("group"), or without the whole day ("day").
    With "group", a share of the tokens (`seen_share`, fixed by article and position) is searched
    with its own entries left in: contexts the memory holds, as a deployed memory meets them (a
    repeated story, a prompt from a memorized article); a third of those are held out (early stopping,
    the rule choice)."""
    ds = memory.ds
    committed = next(d for d in ds.days if d.date == day.date.isoformat())
    ids, docs = np.asarray(ds.shards.shard(committed.shard, "ids")), np.asarray(ds.shards.shard(committed.shard, "docs"))
    names = ds.shards.shard_docs(committed.shard)
    k = memory.index.cfg.k
    dist, values = np.full((len(sample), k), np.inf, np.float32), np.full((len(sample), k), -1, np.int32)
    keys = sample.key.astype(np.float32)
    if leave_out == "day":
        dist[:], values[:] = memory.neighbors(keys, below=int(ids[0]) if len(ids) else None)
    else:
        groups = np.array([day.groups.get(d, d) for d in sample.doc_id], dtype=object)
        draw = _draw(sample)
        seen = draw < memory.calibrator_cfg.seen_share
        if seen.any():
            dist[seen], values[seen] = memory.neighbors(keys[seen])
        for group in np.unique(groups[~seen]):
            rows = np.flatnonzero((groups == group) & ~seen)
            own = {i for i, name in enumerate(names) if day.groups.get(name, name) == group}
            dist[rows], values[rows] = memory.neighbors(keys[rows], exclude=ids[np.isin(docs, list(own))])
        batch = dataclasses.replace(sample, knn_dist=dist, knn_values=values)
        held = seen & (draw < memory.calibrator_cfg.seen_share / 3)
        return examples(batch, memory.lexical(), knn_logprobs_by_temperature(batch), held, seen)
    batch = dataclasses.replace(sample, knn_dist=dist, knn_values=values)
    return examples(batch, memory.lexical(), knn_logprobs_by_temperature(batch))


def held_out_examples(memory: Memory, docs: list[Document], features: Features | None, every: int | None,
                      name: str = "validation") -> Examples | None:
    """Examples of validation articles searched in today's memory: all held out, or (every = n)
    one article in n by id (the paper's scheme, where the rest is trained on)."""
    parts = []
    memory.sync()
    search = functools.partial(memory.search, skip=False) if len(memory) else None
    for batch in (features or memory.features()).scores(docs, name, search, at_once=memory.at_once):
        held = np.array([every is None or _held_out(d, every) for d in batch.doc_id], dtype=bool)
        parts.append(examples(batch, memory.lexical(), knn_logprobs_by_temperature(batch), held))
    return Examples.concat(parts) if parts else None


def _held_out(doc_id: str, every: int) -> bool:
    """Whether a validation article is held back for early stopping (fixed by its id)."""
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % every == 0


def _draw(tokens: TokenScores) -> np.ndarray:
    """A number in [0, 1) per token, fixed by its article and position (the same on every run)."""
    base = np.array([int(hashlib.sha256(d.encode()).hexdigest()[:8], 16) for d in tokens.doc_id], np.uint64)
    mixed = (base + tokens.position.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(1 << 32)
    return ((mixed * np.uint64(2246822519)) % np.uint64(1 << 32)).astype(np.float64) / 2**32


def newest(parts: list[tuple[str, Examples]], tokens: int) -> list[tuple[str, Examples]]:
    """The newest days' examples whose training (not held-out) tokens add up to about `tokens`."""
    kept: list[tuple[str, Examples]] = []
    total = 0
    for name, ex in reversed(parts):
        if kept and total >= tokens:
            break
        kept.insert(0, (name, ex))
        total += int((~ex.holdout).sum())
    return kept


COPY_LAMBDAS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, LAM_CEIL)  # the prior's λ where the memory holds the very context


def _nll(ex: Examples, lam, temperature: float) -> float:
    """Mean NLL of Θ with λ (a number or one per token) on the examples (at least one)."""
    knn = torch.from_numpy(ex.knn_logp[:, TEMPERATURES.index(temperature)].astype(np.float64))
    return -interpolate(torch.from_numpy(ex.lm_logp.astype(np.float64)), knn, torch.as_tensor(lam, dtype=torch.float64)).mean().item()


def rule_nll(ex: Examples, interp: Interpolation, lam_copy: float, calibrator: Calibrator, tolerance: float) -> dict:
    """Mean NLL of each rule on held-out examples: new text (`tokens`, the rules) and contexts the
    memory holds (`seen`: the same)."""
    out = {}
    for part, rows in (("new", ~ex.seen), ("seen", ex.seen)):
        held = ex.take(rows & ex.holdout) if (rows & ex.holdout).any() else ex.take(rows)
        copied = copies(np.expm1(held.density[:, 0].astype(np.float64)), held.key, tolerance)
        lams = {"lm": 0.0, "constant": interp.lam, "prior": prior_lam(copied, interp.lam, lam_copy),
                "calibrator": calibrator.lam(held) if len(held) else 0.0}
        out[part] = {"tokens": len(held)} | {rule: _nll(held, lam, interp.temperature) if len(held) else None
                                               for rule, lam in lams.items()}
    return out["new"] | {"seen": out["seen"]}


THETA_FILES = ("calibrator.pt", "meta.json")  # what Θ reads of a calibration, kept for every day (time travel)


def theta_checksums(folder: Path) -> dict[str, str]:
    """The sha256 of the files of a calibration that Θ reads (monim fsck checks them)."""
    return {f: checksum(folder / f) for f in THETA_FILES}


def retrain_calibrator(ds: Datastore) -> None:
    """A calibrator for the last calibration trained again from its window's examples with the
    settings the memory recorded, in place of a lost or damaged one (a fresh start, not yesterday's
    warm one: close, not the same)."""
    settings = Settings.from_dict(ds.manifest.get("settings") or {}).calibrator
    theta = ds.theta_at()
    folder = ds.root / theta["dir"]
    files = json.loads((folder / "meta.json").read_text())["examples"]
    calibration = Examples.concat([Examples.load(ds.root / p) for p in files])
    calibrator = train_calibrator(calibration, settings, theta["lam"], theta["temperature"])
    calibrator.summary["date"] = theta["date"]
    with replacing(folder / "calibrator.pt") as tmp:
        calibrator.save(tmp)
    ds.commits.set_theta(theta | {"checksums": theta_checksums(folder)})


def calibrate(memory: Memory, day: Day, features: Features | None = None, force: bool = False) -> dict:
    """Add the day's examples to the calibration set, tune the constant (λ, T) on its training part
    and train the calibrator (early stopping on its held-out part); tomorrow's Θ uses them, or the
    LM alone if Θ is worse than the LM on the held-out tokens. Re-running a calibrated day changes
    nothing unless forced. The set keeps the newest days' examples (a constant cost per day).
    """
    with memory.writing():  # one writer at a time; the manifest re-read under the lock
        date = day.date.isoformat()
        theta = memory.ds.theta_at()
        same_day = theta.get("date") == date
        if not len(memory):
            return {"trained": False}
        if same_day and not force:  # what the day's calibration recorded
            meta = json.loads((memory.ds.root / theta["dir"] / "meta.json").read_text())
            return {k: v for k, v in meta.items() if k != "examples"} | {"trained": False}
        ccfg = memory.calibrator_cfg
        root = memory.ds.root
        validation = day.validation[: ccfg.docs_per_day]
        paper = ccfg.source == "validation"
        parts = [held_out_examples(memory, validation, features, ccfg.holdout if paper else None, f"{date}-validation")]
        if not paper and (sample := day_sample(memory, day, features)) is not None:
            parts.insert(0, sample_examples(memory, sample, day, "day" if ccfg.source == "yesterday" else "group"))
        found = [p for p in parts if p is not None and len(p)]
        new = Examples.concat(found) if found else None
        previous = memory.calibration_files()
        previous = previous[:-1] if same_day else previous  # a forced re-run replaces the day's own examples
        name = f"{date}-{uuid.uuid4().hex[:8]}"
        sets = [(p, Examples.load(root / p)) for p in previous] + ([(f"theta/{name}/examples.npz", new)] if new else [])
        kept = newest(sets, ccfg.window_tokens)
        calibration = Examples.concat([ex for _, ex in kept])
        fresh = ~calibration.holdout & ~calibration.seen  # the constant λ is for new text
        train = calibration.take(fresh) if fresh.any() else calibration.take(~calibration.seen)
        interp, _ = tune_grid(train.lm_logp.astype(np.float64), train.knn_logp.astype(np.float64))
        held = calibration.take(~calibration.holdout & calibration.seen)
        copied = copies(np.expm1(held.density[:, 0].astype(np.float64)), held.key, ccfg.copy_tolerance)
        lam_copy = min(COPY_LAMBDAS, key=lambda c: _nll(held, prior_lam(copied, interp.lam, c), interp.temperature)
                       ) if len(held) else interp.lam
        start = memory.calibrator() if ccfg.warm_start and not same_day else None
        epochs = warm_epochs(ccfg, len(previous)) if start is not None else ccfg.max_epochs
        calibrator = train_calibrator(calibration, ccfg, interp.lam, interp.temperature, start, epochs)
        calibrator.summary["date"] = date
        nll = rule_nll(calibration, interp, lam_copy, calibrator, ccfg.copy_tolerance)
        summary = {"date": date, "lam": interp.lam, "temperature": interp.temperature, "lam_copy": lam_copy,
                  "calibration_tokens": len(calibration), "new_tokens": len(new) if new else 0, "source": ccfg.source,
                  "nll": nll, "rule": choose_rule(nll), "calibrator": calibrator.summary}
        with replacing(root / "theta" / name) as tmp:
            tmp.mkdir()
            if new is not None:
                new.save(tmp / "examples.npz")
            calibrator.save(tmp / "calibrator.pt")
            write_json(tmp / "meta.json", summary | {"examples": [p for p, _ in kept]})
        memory.ds.commits.set_theta({"lam": interp.lam, "temperature": interp.temperature, "lam_copy": lam_copy, "date": date,
                             "dir": f"theta/{name}", "nll": nll, "checksums": theta_checksums(root / "theta" / name)})
        for p, _ in sets[: len(sets) - len(kept)]:  # out of the window: only the calibrators are kept
            (root / p).unlink(missing_ok=True)
        sample_path(memory, date).unlink(missing_ok=True)
        return summary | {"trained": True}
