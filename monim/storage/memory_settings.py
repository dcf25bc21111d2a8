"""A memory's settings: everything it is learned and read with, recorded in its manifest at its first commit.

Θ is the LM (its weights in a dtype), a memory as of a day, its calibrator, and the settings below.
Whoever reads a memory (the day flow, the suite, the champion gate, the served model, `eval`,
`generate`) reads it with these, so that all of them score the same Θ. A reader may change how it
reads (`READ`: the kNN search's depth, the constant λ, the skip rule, recency, throughput); a
setting that shaped what was learned (the window the keys were computed with, the index, how the
calibrator was trained) cannot be changed by a reader, and a writer that brings other values is
refused before any work, naming the field. The policy's parameters (δ, ...) shaped what was learned
too: a writer that brings others is refused; a reader reads the memory as it is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from monim.core.config import CalibratorConfig, IndexConfig, PolicyConfig, ScoreConfig
from monim.core.manifest import recorded
from monim.core.recency import Recency
from monim.core.run_config import RunConfig

# how fast, not what: never recorded as a difference
THROUGHPUT = {"window.batch_size", "window.head_chunk", "index.query_batch", "index.gpu", "index.map_above"}
# what a reader may change without changing what was learned
READ = THROUGHPUT | {"dtype", "calibrated", "index.k", "index.nprobe", "calibrator.skip_threshold",
                     "calibrator.gate_k", "calibrator.copy_tolerance", "recency.half_life", "recency.max_age"} | {
    f"policy.{f.name}" for f in fields(PolicyConfig)}  # the policy shaped what was learned; a reader reads it as it is
SECTIONS = {"window": ScoreConfig, "index": IndexConfig, "calibrator": CalibratorConfig, "recency": Recency,
            "policy": PolicyConfig}


class SettingsMismatch(ValueError):
    """A memory was learned with other settings than the ones it is opened with."""


@dataclass(frozen=True)
class Settings:
    """How a memory is learned and Θ reads it: the LM's dtype, the scoring window, the index, the
    calibrator, recency and the policy's parameters."""

    dtype: str = "auto"  # the LM's weights: auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16, float16
    calibrated: bool = True  # Θ's λ per token from the NN calibrator (False: the constant λ)
    window: ScoreConfig = field(default_factory=ScoreConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    calibrator: CalibratorConfig = field(default_factory=CalibratorConfig)
    recency: Recency = field(default_factory=Recency)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @classmethod
    def of(cls, cfg: RunConfig) -> Settings:
        """What a run's Θ is learned and read with: its memory records these at its first commit."""
        return cls(cfg.dtype, cfg.calibrated, cfg.window(), cfg.index(), cfg.calibrator, policy=cfg.policy_config())

    def flat(self) -> dict:
        """{"dtype": ..., "window.stride": ..., ...}: every setting by its dotted name."""
        out = {"dtype": self.dtype, "calibrated": self.calibrated}
        for section in SECTIONS:
            out |= {f"{section}.{k}": v for k, v in asdict(getattr(self, section)).items()}
        return out

    def as_dict(self) -> dict:
        """JSON for the manifest."""
        out = {"dtype": self.dtype, "calibrated": self.calibrated}
        for section in SECTIONS:
            out[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(getattr(self, section)).items()}
        return out

    @classmethod
    def from_dict(cls, saved: dict) -> Settings:
        """Settings as a manifest recorded them (fields a newer monim added take their defaults)."""
        parts = {}
        for section, kind in SECTIONS.items():
            known = {f.name for f in fields(kind)}
            parts[section] = kind(**{k: v for k, v in saved.get(section, {}).items() if k in known})
        return cls(saved.get("dtype", "auto"), saved.get("calibrated", True), **parts)

    def with_(self, **changes) -> Settings:
        """These settings with some changed, each by its dotted or its plain name (k, skip_threshold, stride, ...)."""
        names = self.flat()
        plain: dict[str, list[str]] = {}
        for name in names:
            plain.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        sections: dict[str, dict] = {}
        top = {}
        for key, value in changes.items():
            full = [key] if key in names else plain.get(key, [])
            if len(full) != 1:
                raise TypeError(f"unknown setting {key!r}" if not full else f"{key!r} is ambiguous: say {' or '.join(full)}")
            if "." in full[0]:
                section, name = full[0].split(".")
                sections.setdefault(section, {})[name] = value
            else:
                top[full[0]] = value
        parts = {s: replace(getattr(self, s), **v) for s, v in sections.items()}
        return replace(self, **top, **parts)

    def differences(self, other: Settings, ignore: set[str] = THROUGHPUT) -> dict[str, tuple]:
        """{name: (mine, theirs)} of the settings that differ, apart from `ignore`."""
        mine, theirs = self.flat(), other.flat()
        return {k: (mine[k], theirs[k]) for k in mine if k not in ignore and mine[k] != theirs[k]}

    def read_with(self, **overrides) -> Settings:
        """These (recorded) settings as a reader asks to read them; a change to what was learned is refused."""
        wanted = self.with_(**overrides)
        learned = self.differences(wanted, READ)
        if learned:
            raise SettingsMismatch("; ".join(f"{k}: the memory was learned with {a!r}, not {b!r} (a reader cannot change "
                                             "it)" for k, (a, b) in learned.items()))
        return wanted


def refuse_other(manifest: dict, model: str, settings: Settings, may_differ: set[str] = THROUGHPUT,
                 where: Path | str = "") -> None:
    """Refuse to learn into (or read) a memory with another model or other settings than it was
    learned with, naming each field that differs (a memory from before monim recorded its settings
    takes these)."""
    differ = {"model": (manifest["model"], model)} if manifest.get("model", model) != model else {}
    if "settings" in manifest:
        differ |= Settings.from_dict(recorded(manifest)).differences(settings, may_differ)
    if differ:
        raise SettingsMismatch(f"{where}: " + "; ".join(f"field '{k}': learned with {a!r}, not {b!r}" for k, (a, b)
                                                        in differ.items()) + " (use the memory's settings, or another "
                               "work directory)")


WINDOW = ("stride", "context", "context_mode", "sink")  # what shapes a key: the rest of ScoreConfig is throughput


def window_differences(a: ScoreConfig, b: ScoreConfig) -> dict[str, tuple]:
    """{field: (a's, b's)} of the window settings that differ."""
    return {k: (getattr(a, k), getattr(b, k)) for k in WINDOW if getattr(a, k) != getattr(b, k)}
