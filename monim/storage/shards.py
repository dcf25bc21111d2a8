"""A datastore's shards read: each committed day's arrays (mapped, or pinned open for a long-lived
reader), its documents, titles, articles and the ids it read, and the per-entry arrays across days
(values and weights by id, an entry's day and row, its key). A Datastore owns one, following its manifest.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np

from monim.core.manifest import CommittedDay, Damaged
from monim.storage import articles
from monim.storage.entries import DTYPES

WEIGHTS = "weights"  # a per-entry array only some shards have (monim.learning.merging)


class Shards:
    """The arrays of the days a datastore's manifest commits, read."""

    def __init__(self, root: Path, manifest: dict):
        self.root = root
        self.manifest = manifest
        self._values: np.ndarray | None = None
        self._weights: np.ndarray | None = None
        self._pinned: dict[str, dict[str, Any]] | None = None  # shard -> its files, opened by pin()

    def follow(self, manifest: dict, unpin: bool = False) -> None:
        """Read the days `manifest` commits from now on (the tables by id made again when next asked;
        with `unpin`, the pinned files let go)."""
        self.manifest = manifest
        self._values = self._weights = None
        if unpin:
            self._pinned = None

    def select(self, dates: list[str], version: int | str) -> Shards:
        """These days' shards alone, as a manifest at `version` would commit them (read-only; pinned files kept)."""
        days = [d for d in self.manifest["days"] if d["date"] in dates]
        selected = copy.copy(self)
        selected.follow({**self.manifest, "days": days, "entries": sum(d["entries"] for d in days), "version": version})
        return selected

    @property
    def days(self) -> list[CommittedDay]:
        """The committed days, in order."""
        return [CommittedDay(**d) for d in self.manifest["days"]]

    def committed(self, date: dt.date | str) -> bool:
        return any(d["date"] == str(date) for d in self.manifest["days"])

    def pin(self) -> None:
        """Open every committed shard's files now (arrays mapped, not read): a long-lived reader pinned so
        answers from them even after a forget or a replaced day removed them from the directory (a
        mapping outlives the file's name), until it opens the memory's new state."""
        pinned: dict[str, dict[str, Any]] = {}
        for d in self.days:
            folder = self.root / "shards" / d.shard
            files = {p.name: self._load(p, d.shard) if p.suffix == ".npy" else json.loads(p.read_text())
                     for p in folder.iterdir() if p.suffix in (".npy", ".json")}
            if "docs.json" not in files:
                raise FileNotFoundError(f"{folder / 'docs.json'}: the shard of {d.date} is incomplete")
            pinned[d.shard] = files
        self._pinned = pinned

    def _held(self, name: str) -> dict[str, Any] | None:
        """A pinned shard's files by name (None: read from the directory)."""
        return None if self._pinned is None else self._pinned.get(name)

    def shard(self, name: str, array: str, mmap: bool = True) -> np.ndarray:
        if (held := self._held(name)) is not None:
            return held[f"{array}.npy"] if mmap else np.array(held[f"{array}.npy"])
        return self._load(self.root / "shards" / name / f"{array}.npy", name, mmap)

    def _load(self, path: Path, name: str, mmap: bool = True) -> np.ndarray:
        """A shard's array (mapped, not read), or a refusal naming the file and its day (truncated, not an array)."""
        try:
            return np.load(path, mmap_mode="r" if mmap else None)
        except (OSError, ValueError) as e:
            if isinstance(e, FileNotFoundError) and not path.parent.is_dir():
                raise  # the whole shard replaced since this state was read (a forget, a day again): stale, not damaged
            date = next((d.date for d in self.days if d.shard == name), "?")
            raise Damaged.of(f"{path}: cannot be read ({e}): the shard of day {date} is damaged", date) from None

    def has_array(self, name: str, array: str) -> bool:
        if (held := self._held(name)) is not None:
            return f"{array}.npy" in held
        return (self.root / "shards" / name / f"{array}.npy").exists()

    def shard_docs(self, name: str) -> list[str]:
        if (held := self._held(name)) is not None:
            return held["docs.json"]
        return json.loads((self.root / "shards" / name / "docs.json").read_text())

    def shard_titles(self, name: str) -> list[str] | None:
        """The headlines of a shard's documents (aligned with shard_docs), if they were stored."""
        if (held := self._held(name)) is not None:
            return held.get("titles.json")
        path = self.root / "shards" / name / "titles.json"
        return json.loads(path.read_text()) if path.exists() else None

    def shard_seen(self, name: str) -> list[str]:
        """The ids of every article the shard's day read (its docs and articles where written before
        monim kept them)."""
        if self.has_array(name, articles.SEEN):
            return articles.unpack(self.shard(name, articles.SEEN))
        return list(dict.fromkeys([*self.shard_docs(name), *(a[0] for a in self.shard_articles(name))]))

    def shard_articles(self, name: str) -> list[list[str]]:
        """The [id, title, text] of a shard's articles ([] where written before monim kept them)."""
        return articles.unpack(self.shard(name, articles.ARRAY)) if self.has_array(name, articles.ARRAY) else []

    def array(self, name: str) -> np.ndarray:
        """One array over all committed entries, in commit order (keys come as fp16)."""
        parts = [self.shard(d.shard, name) for d in self.days]
        if parts:
            return np.concatenate(parts)
        return np.empty((0, self.manifest["hidden_size"]) if name == "keys" else 0, DTYPES[name])

    def values_by_id(self) -> np.ndarray:
        """int32 value of each entry id (-1 for ids removed by forget), for kNN lookups."""
        if self._values is None:
            table = np.full(self.manifest["next_id"], -1, dtype=np.int32)
            for d in self.days:
                table[self.shard(d.shard, "ids")] = self.shard(d.shard, "values")
            self._values = table
        return self._values

    def weights_by_id(self) -> np.ndarray | None:
        """int32 weight of each entry id (1 where a shard keeps none), or None if no shard keeps weights."""
        if self._weights is None:
            kept = [d for d in self.days if self.has_array(d.shard, WEIGHTS)]
            if not kept:
                return None
            table = np.ones(self.manifest["next_id"], dtype=np.int32)
            for d in kept:
                table[self.shard(d.shard, "ids")] = self.shard(d.shard, WEIGHTS)
            self._weights = table
        return self._weights

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where committed entry ids (any shape) are: the index of each one's day in `days` and its
        row in that day's shard (both -1 for an id not held)."""
        flat = np.asarray(ids, np.int64).ravel()
        day, row = np.full(len(flat), -1, np.int64), np.full(len(flat), -1, np.int64)
        for i, d in enumerate(self.days):
            if not d.entries:
                continue
            shard_ids = np.asarray(self.shard(d.shard, "ids"))
            rows = np.searchsorted(shard_ids, flat)  # ids grow within a shard
            here = (rows < len(shard_ids)) & (shard_ids[rows.clip(max=len(shard_ids) - 1)] == flat)
            day[here], row[here] = i, rows[here]
        return day.reshape(np.shape(ids)), row.reshape(np.shape(ids))

    def keys_of(self, ids: np.ndarray) -> np.ndarray:
        """float32 keys of committed entry ids (any shape), read from the shards (exact, unlike PQ codes)."""
        day, row = (a.ravel() for a in self.locate(ids))
        out = np.empty((len(day), self.manifest["hidden_size"]), np.float32)
        for i in np.unique(day[day >= 0]):
            here = day == i
            out[here] = self.shard(self.days[i].shard, "keys")[row[here]]
        return out.reshape(*np.shape(ids), -1)
