"""Datastore: the append-only key/value memory on disk, committed one day at a time, atomically.

Layout of a memory directory:
    manifest.json          what is committed (written last, by rename): days, shards, counts, each
                           day's evaluation (its row of metrics, once evaluated), and Θ's history
                           (`thetas`: each calibration's date, folder, λ, T, held-out NLL), `forgotten` (monim.storage.forgotten)
    shards/<name>/         one per committed day: keys.npy (fp16 [n, d]), values.npy (int32),
                           ids.npy (int64, stable entry ids), docs.npy (int32 index into
                           docs.json), positions.npy (int32 token position in the document),
                           weights.npy (int32, Greedy Merging only: how many entries each one stands for),
                           the day's text: lexical counts, twin signatures, its articles and every id read (monim.storage.articles)
    index/                 the FAISS index over the keys (monim.storage.index), rebuilt if stale
    parts/                 instead, once the index outgrows `part_bytes`: its parts by day range (monim.storage.parts)
Files not named by the manifest (left by a crash) are ignored and removed on the next commit.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
from pathlib import Path

from monim.core.atomic import checksum
from monim.core.manifest import FORMAT, IDENTITY, CommittedDay, MemoryMismatch, read_manifest, upgrade
from monim.storage.commits import Commits
from monim.storage.shards import Shards


class Datastore:
    """A memory directory's entries and records: the manifest, its days read by `shards` and changed by `commits`.

    Its shards (monim.storage.shards.Shards) read the arrays of the days the manifest commits; its
    commits (monim.storage.commits.Commits) write them, every change published by one manifest rename.
    `identity` (model, hidden size, tokenizer and weights hashes) says which LM's keys it holds: one
    that differs from the manifest's is refused; None opens the memory as its manifest says."""

    def __init__(self, root: Path | str, identity: dict | None = None):
        self.root = Path(root)
        path = self.root / "manifest.json"
        if path.exists():
            manifest = read_manifest(path)
            for key, want in (identity or {}).items():
                have = manifest.get(key)
                if have is None:  # written before monim recorded it (the weights): kept from now on
                    manifest[key] = want
                elif have != want:
                    raise MemoryMismatch(f"{path}: field '{key}': learned with {have!r}, but this LM has {want!r}; "
                                         "read it with the LM it was learned with, or learn into another work directory")
        elif identity is None:
            raise FileNotFoundError(f"no memory at {root} (missing {path.name})")
        else:
            manifest = {"format": FORMAT, **identity, "key_dtype": "float16", "version": 0,
                        "next_id": 0, "entries": 0, "days": [], "thetas": []}
        self.identity = {k: manifest[k] for k in IDENTITY if k in manifest}
        self.shards = Shards(self.root, upgrade(manifest, self.root))
        self.commits = Commits(self.shards)

    @property
    def manifest(self) -> dict:
        """What is committed, as last read or published."""
        return self.shards.manifest

    @property
    def lock(self) -> Path:
        """The file whose lock every writer of this memory holds (monim.core.lock.hold)."""
        return self.root / ".lock"

    def reload(self) -> bool:
        """Re-read the manifest (another process may have committed since); whether it changed."""
        path = self.root / "manifest.json"
        manifest = upgrade(read_manifest(path), self.root) if path.exists() else self.manifest
        for key in ("settings", *IDENTITY):  # kept for the next commit where the file lacks them
            if key in self.manifest and key not in manifest:
                manifest[key] = self.manifest[key]
        changed = manifest != self.manifest
        if changed:
            self.shards.follow(manifest, unpin=True)
        return changed

    @classmethod
    def read(cls, root: Path | str) -> Datastore:
        """Open an existing memory as its manifest describes it (no LM needed)."""
        return cls(root)

    @classmethod
    def for_lm(cls, root: Path | str, lm) -> Datastore:
        """Open (or start) the memory at `root` for an `monim.lm.model.LM`."""
        return cls(root, {"model": lm.name, "hidden_size": lm.hidden_size, "tokenizer": lm.fingerprint,
                          "weights": lm.weights})

    def view(self, dates: list[str], version: int | str) -> Datastore:
        """These days of the memory as a datastore of their own at `version`, read-only: a part's index reads it (monim.storage.parts)."""
        view = copy.copy(self)
        view.shards = self.shards.select(dates, version)
        return view

    @property
    def version(self) -> int:
        return self.manifest["version"]

    @property
    def state(self) -> tuple:
        """What changes with every change to the entries (a commit, a forget, a merge; cheap to compare):
        the version and the days' shards (a shard rewritten is named anew)."""
        return self.version, tuple(d["shard"] for d in self.manifest["days"])

    @property
    def days(self) -> list[CommittedDay]:
        return self.shards.days

    def days_at(self, as_of: str | None = None) -> list[CommittedDay]:
        """The committed days up to the end of day `as_of` (None: all of them)."""
        return [d for d in self.days if as_of is None or d.date <= as_of]

    def __len__(self) -> int:
        return self.manifest["entries"]

    def committed(self, date: dt.date | str) -> bool:
        return self.shards.committed(date)

    def evaluations(self) -> dict[str, dict]:
        """The row of metrics of each evaluated day (date -> row)."""
        return {d["date"]: d["evaluation"] for d in self.manifest["days"] if d.get("evaluation")}

    @property
    def tokens_seen(self) -> int:
        return sum(d.tokens_seen for d in self.days)

    @property
    def memrate(self) -> float:
        """Cumulative MemRate: entries stored / tokens FullMem would have stored."""
        seen = self.tokens_seen
        return len(self) / seen if seen else 0.0

    def bytes_on_disk(self) -> int:
        """Bytes of the committed shards (the index is counted by monim.storage.index; the manifest, which
        also holds each day's metrics, is bookkeeping, not memory)."""
        files = [p for d in self.days for p in (self.root / "shards" / d.shard).iterdir()]
        return sum(p.stat().st_size for p in files)

    def checksum(self, as_of: str | None = None) -> str:
        """A hash of what Θ reads as of the end of day `as_of` (None: the latest): its days' shards
        (their files' own checksums), the calibration and the calibrator file; it changes when any of
        them does (a forgotten article, a calibration)."""
        days = [(d.date, d.shard, d.entries, d.checksums) for d in self.days_at(as_of)]
        theta = self.theta_at(as_of)
        calibrator = self.root / theta["dir"] / "calibrator.pt" if theta.get("dir") else None
        parts = [days, theta, checksum(calibrator) if calibrator and calibrator.exists() else None]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def theta_at(self, as_of: str | None = None) -> dict:
        """Θ's settings as of the end of day `as_of` (None: the latest)."""
        thetas = [t for t in self.manifest["thetas"] if as_of is None or t["date"] <= as_of]
        return thetas[-1] if thetas else {}
