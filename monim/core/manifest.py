"""A memory's manifest: the one truth of what it holds (which LM's keys, the committed days with
their checksums and evaluations, Θ's history, the settings it is read with), read whole or refused
with a message naming the file, and upgraded from the shapes older versions wrote."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1
IDENTITY = ("model", "hidden_size", "tokenizer", "weights")  # which LM's keys a memory holds


class MemoryMismatch(ValueError):
    """The memory directory was built by another model, tokenizer or weights."""


class ManifestError(ValueError):
    """A manifest that cannot be read: the message names the file and what is wrong."""


class Damaged(ValueError):
    """A memory's file that differs from its commit or cannot be read: Θ is not answered from it."""

    @classmethod
    def of(cls, what: str, date: str) -> Damaged:
        """The refusal: what is wrong (naming the file and day), and the way out."""
        return cls(f"{what}; Θ is not answered from a damaged memory: forget the day (`monim forget --day {date}`) "
                   "or restore the file (`monim fsck` lists every damaged file)")


def read_manifest(path: Path) -> dict:
    """A memory's manifest, or a ManifestError naming the file and what is wrong (a line and column, or a
    format newer than this monim reads)."""
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: line {e.lineno} column {e.colno}: {e.msg} (the manifest is damaged; "
                            "`monim fsck` says what can be recovered)") from None
    if not isinstance(manifest, dict) or "days" not in manifest:
        raise ManifestError(f"{path}: not a monim manifest (no 'days')")
    if isinstance(manifest.get("format"), int) and manifest["format"] > FORMAT:
        raise ManifestError(f"{path}: field 'format': {manifest['format']}: written by a newer monim (this one reads "
                            f"format {FORMAT} and older); read it with the monim that wrote it")
    return manifest


@dataclass
class CommittedDay:
    """One committed day in the manifest."""

    date: str
    shard: str
    tokens_seen: int  # what FullMem would store
    entries: int
    policy: str
    params: dict = field(default_factory=dict)
    forgotten: int = 0
    merged: int = 0  # entries absorbed by later days' entries (Greedy Merging)
    searched: int = 0  # training tokens the day's decision searched in the memory (MoNIM; the index regime reads it)
    checksums: dict = field(default_factory=dict)  # file -> sha256, written at commit (monim fsck reads them)
    evaluation: dict = field(default_factory=dict)  # the day's row of metrics, once evaluated (monim.storage.workdirs)

    @property
    def memrate(self) -> float:
        return self.entries / self.tokens_seen if self.tokens_seen else 0.0


def _theta_history(root: Path) -> list[dict]:
    """Θ's history of a memory written before the manifest kept it: from its calibration folders
    (a day calibrated twice counts its last calibration)."""
    metas = sorted((root / "theta").glob("*/meta.json"), key=lambda p: (p.parent.name[:10], p.stat().st_mtime_ns))
    history: dict[str, dict] = {}
    for path in metas:
        meta = json.loads(path.read_text())
        history[meta["date"]] = {k: meta[k] for k in ("lam", "temperature", "date", "nll") if k in meta} | {
            "dir": f"theta/{path.parent.name}"}
    return list(history.values())


def upgrade(manifest: dict, root: Path) -> dict:
    """A manifest in today's shape: Θ's history kept in it (older ones wrote only the latest Θ)."""
    if "thetas" not in manifest:
        manifest["thetas"] = _theta_history(root)
    manifest.pop("theta", None)  # the latest Θ is thetas[-1]
    return manifest


def recorded(manifest: dict) -> dict:
    """The settings a manifest recorded (as JSON); one from before the policy's parameters were
    recorded takes δ and Greedy Merging's k from its first day's policy params."""
    saved = manifest.get("settings") or {}
    if "policy" not in saved and manifest.get("days"):
        params = manifest["days"][0].get("params") or {}
        saved = saved | {"policy": {mine: params[theirs] for mine, theirs in (("delta", "delta"), ("merge_k", "k"))
                                    if theirs in params}}
    return saved
