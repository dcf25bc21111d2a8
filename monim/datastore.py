"""Datastore: the append-only key/value memory on disk, committed one day at a time, atomically.

Layout of a memory directory:
    manifest.json          what is committed (written last, by rename): days, shards, counts, each
                           day's evaluation (its row of metrics, once evaluated), and Θ's history
                           (`thetas`: each calibration's date, folder, λ, T, held-out NLL), `forgotten` (monim.forgotten)
    shards/<name>/         one per committed day: keys.npy (fp16 [n, d]), values.npy (int32),
                           ids.npy (int64, stable entry ids), docs.npy (int32 index into
                           docs.json), positions.npy (int32 token position in the document),
                           weights.npy (int32, Greedy Merging only: how many entries each one stands for),
                           the day's text: lexical counts, twin signatures, its articles and every id read (monim.articles)
    index/                 the FAISS index over the keys (monim.index), rebuilt if stale
Files not named by the manifest (left by a crash) are ignored and removed on the next commit.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import uuid
from pathlib import Path

import numpy as np

from monim import articles, forgotten
from monim.atomic import checksum, replacing, write_json
from monim.entries import DTYPES, Entries
from monim.manifest import FORMAT, IDENTITY, DayRecord, MemoryMismatch, read_manifest, upgrade

WEIGHTS = "weights"  # a per-entry array only some shards have (monim.merging)


class Datastore:
    """The memory's entries on disk; every change is published by one manifest rename.

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
        self.manifest = upgrade(manifest, self.root)
        self._values: np.ndarray | None = None
        self._weights: np.ndarray | None = None
        self._pinned: dict[str, dict[str, object]] | None = None  # shard -> its files, opened by pin()

    @property
    def lock(self) -> Path:
        """The file whose lock every writer of this memory holds (monim.lock.hold)."""
        return self.root / ".lock"

    def reload(self) -> bool:
        """Re-read the manifest (another process may have committed since); whether it changed."""
        path = self.root / "manifest.json"
        manifest = upgrade(read_manifest(path), self.root) if path.exists() else self.manifest
        for key in ("settings", *IDENTITY):  # kept for the next commit where the file lacks them
            if key in self.manifest and key not in manifest:
                manifest[key] = self.manifest[key]
        changed = manifest != self.manifest
        self.manifest = manifest
        if changed:
            self._values = self._weights = self._pinned = None
        return changed

    @classmethod
    def read(cls, root: Path | str) -> Datastore:
        """Open an existing memory as its manifest describes it (no LM needed)."""
        return cls(root)

    @classmethod
    def for_lm(cls, root: Path | str, lm) -> Datastore:
        """Open (or start) the memory at `root` for an `monim.lm.LM`."""
        return cls(root, {"model": lm.name, "hidden_size": lm.hidden_size, "tokenizer": lm.fingerprint,
                          "weights": lm.weights})

    # --- reading ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.manifest["version"]

    @property
    def days(self) -> list[DayRecord]:
        return [DayRecord(**d) for d in self.manifest["days"]]

    def __len__(self) -> int:
        return self.manifest["entries"]

    def committed(self, date: dt.date | str) -> bool:
        return any(d["date"] == str(date) for d in self.manifest["days"])

    def evaluations(self) -> dict[str, dict]:
        """The row of metrics of each evaluated day (date -> row)."""
        return {d["date"]: d["evaluation"] for d in self.manifest["days"] if d.get("evaluation")}

    def pin(self) -> None:
        """Open every committed shard's files now (arrays mapped, not read): a long-lived reader pinned so
        answers from them even after a forget or a replaced day removed them from the directory (a
        mapping outlives the file's name), until it opens the memory's new state."""
        pinned: dict[str, dict[str, object]] = {}
        for d in self.days:
            folder = self.root / "shards" / d.shard
            files = {p.name: np.load(p, mmap_mode="r") if p.suffix == ".npy" else json.loads(p.read_text())
                     for p in folder.iterdir() if p.suffix in (".npy", ".json")}
            if "docs.json" not in files:
                raise FileNotFoundError(f"{folder / 'docs.json'}: the shard of {d.date} is incomplete")
            pinned[d.shard] = files
        self._pinned = pinned

    def _held(self, name: str) -> dict[str, object] | None:
        """A pinned shard's files by name (None: read from the directory)."""
        return None if self._pinned is None else self._pinned.get(name)

    def shard(self, name: str, array: str, mmap: bool = True) -> np.ndarray:
        if (held := self._held(name)) is not None:
            return held[f"{array}.npy"] if mmap else np.array(held[f"{array}.npy"])
        return np.load(self.root / "shards" / name / f"{array}.npy", mmap_mode="r" if mmap else None)

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
        return np.empty((0, self.identity["hidden_size"]) if name == "keys" else 0, DTYPES[name])

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
        out = np.empty((len(day), self.identity["hidden_size"]), np.float32)
        for i in np.unique(day[day >= 0]):
            here = day == i
            out[here] = self.shard(self.days[i].shard, "keys")[row[here]]
        return out.reshape(*np.shape(ids), -1)

    @property
    def tokens_seen(self) -> int:
        return sum(d.tokens_seen for d in self.days)

    @property
    def memrate(self) -> float:
        """Cumulative MemRate: entries stored / tokens FullMem would have stored."""
        seen = self.tokens_seen
        return len(self) / seen if seen else 0.0

    def bytes_on_disk(self) -> int:
        """Bytes of the committed shards (the index is counted by monim.index; the manifest, which
        also holds each day's metrics, is bookkeeping, not memory)."""
        files = [p for d in self.days for p in (self.root / "shards" / d.shard).iterdir()]
        return sum(p.stat().st_size for p in files)

    # --- writing ---------------------------------------------------------------------------

    def commit_day(self, date: dt.date | str, entries: Entries, tokens_seen: int, policy: str,
                   params: dict | None = None, force: bool = False, text: dict[str, np.ndarray] | None = None,
                   titles: dict[str, str] | None = None, weights: np.ndarray | None = None,
                   merged: np.ndarray | None = None, searched: int = 0) -> bool:
        """Append one day's entries atomically; False (no change) if the day is already committed.

        With force, a committed day is replaced, but only if it is the last one. `text`: arrays
        describing the day's training text (monim.lexical.day_counts), kept in the day's shard;
        `titles`: the documents' headlines (doc id -> title), shown as sources. Greedy Merging:
        `weights` of the entries, and the ids of older entries they absorbed (`merged`), removed
        from their shards in the same commit. `searched`: training tokens the day's decision searched.
        A day the memory forgot is refused (monim.forgotten.ForgottenDay) until relearned by name.
        """
        date = str(date)
        days = list(self.manifest["days"])
        if self.committed(date):
            if not force:
                return False
            if days[-1]["date"] != date:
                raise ValueError(f"day {date} is committed and is not the last day ({days[-1]['date']}): "
                                 "only the last day can be replaced")
            days.pop()
        else:
            self.appendable(date)
        if len(entries) and entries.keys.shape[1] != self.identity["hidden_size"]:
            raise ValueError(f"keys have {entries.keys.shape[1]} dims, memory has {self.identity['hidden_size']}")

        next_id = self.manifest["next_id"]
        docs = sorted(set(entries.doc_ids))
        doc_index = {d: i for i, d in enumerate(docs)}
        arrays = {
            "keys": entries.keys,
            "values": entries.values,
            "ids": np.arange(next_id, next_id + len(entries)),
            "docs": np.array([doc_index[d] for d in entries.doc_ids]),
            "positions": entries.positions,
        }
        arrays = {a: np.ascontiguousarray(arr, dtype=DTYPES[a]) for a, arr in arrays.items()} | (text or {})
        if weights is not None:
            arrays[WEIGHTS] = np.ascontiguousarray(weights, dtype=np.int32)
        if merged is not None and len(merged):
            days = [self._without(rec, merged) for rec in days]
        name = f"{len(days):06d}-{date}-{uuid.uuid4().hex[:8]}"
        sums = self._write_shard(name, arrays, docs, [titles.get(d, "") for d in docs] if titles else None)
        days.append(DayRecord(date, name, int(tokens_seen), len(entries), policy, params or {},
                              searched=int(searched), checksums=sums).__dict__)
        self._publish(days, next_id=next_id + len(entries))
        return True

    def appendable(self, date: str) -> None:
        """Refuse a day the memory cannot add: one before its last day, or one it forgot (ForgottenDay)."""
        if self.manifest["days"] and date < self.manifest["days"][-1]["date"]:
            raise ValueError(f"day {date} comes before the last committed day {self.manifest['days'][-1]['date']}")
        forgotten.refuse(self.manifest, date)

    def forget(self, doc_ids: list[str] | None = None, days: list[dt.date | str] | None = None,
               reason: str | None = None) -> int:
        """Remove the entries of these documents and/or days; returns how many were removed. The last
        committed day, named, is uncommitted: the memory returns to its state before the day (its
        entries, evaluation and calibration gone). Whatever a forget changes is logged in the manifest
        (monim.forgotten, with `reason`): a forgotten day is never learned again unless relearned by name."""
        drop_docs, drop_days = set(doc_ids or ()), {str(d) for d in days or ()} - set(forgotten.forgotten_days(self.manifest))
        last = self.manifest["days"][-1]["date"] if self.manifest["days"] else None
        removed, new_days, gone, held = 0, [], {}, {}
        for rec in map(dict, self.manifest["days"]):
            if rec["date"] in drop_days:
                removed, gone[rec["date"]] = removed + rec["entries"], self.shard_seen(rec["shard"])
                if rec["date"] == last:  # uncommitted (its ids are not used again: ids stay stable)
                    continue
                rec.update(entries=0, forgotten=rec["forgotten"] + rec["entries"], **self._rewrite(rec, None))
            elif drop_docs:
                docs, names = np.asarray(self.shard(rec["shard"], "docs")), self.shard_docs(rec["shard"])
                keep = ~np.isin(docs, [i for i, d in enumerate(names) if d in drop_docs])  # (a forgotten one keeps its name)
                in_articles = {a[0] for a in self.shard_articles(rec["shard"])} & drop_docs
                if not keep.all() or in_articles:
                    removed += int((~keep).sum())
                    held |= {names[i]: rec["date"] for i in np.unique(docs[~keep])} | dict.fromkeys(in_articles, rec["date"])
                    rec.update(entries=int(keep.sum()), forgotten=rec["forgotten"] + int((~keep).sum()),
                               **self._rewrite(rec, keep, drop_docs))
            new_days.append(rec)
        if gone or held:
            thetas = [t for t in self.manifest["thetas"] if last not in gone or t["date"] != last]
            event = forgotten.forget_event(gone, held, reason)
            self.manifest = dict(self.manifest, thetas=thetas, forgotten=[*forgotten.log(self.manifest), event])
            self._publish(new_days, next_id=self.manifest["next_id"])
        return removed

    def relearn(self, date: str) -> None:
        """Let a day be learned again, asked by name: the last committed day is uncommitted (its entries,
        evaluation and calibration gone), a forgotten one after it no longer refused; logged."""
        forgotten.check_relearn(self.manifest, date)
        days = self.manifest["days"]
        kept = days[:-1] if days and days[-1]["date"] == date else days
        self.manifest = dict(self.manifest, thetas=[t for t in self.manifest["thetas"] if t["date"] != date],
                             forgotten=[*forgotten.log(self.manifest), forgotten.relearn_event(date)])
        self._publish(kept, next_id=self.manifest["next_id"], bump=len(kept) != len(days))

    def _without(self, rec: dict, merged: np.ndarray) -> dict:
        """A day's record with the merged entry ids removed from its shard (rewritten if any was there)."""
        if not rec["entries"]:
            return rec
        keep = ~np.isin(self.shard(rec["shard"], "ids"), merged)
        if keep.all():
            return rec
        rec = dict(rec, merged=rec.get("merged", 0) + int((~keep).sum()), entries=int(keep.sum()))
        return rec | self._rewrite(rec, keep)

    def set_theta(self, theta: dict) -> None:
        """Record the semiparametric model's settings (λ, T, date, dir, ...) the next day will score
        with, and add them to Θ's history (a day calibrated again replaces its entry)."""
        self._publish(self.manifest["days"], next_id=self.manifest["next_id"], theta=theta, bump=False)

    def record_evaluation(self, date: str, row: dict) -> None:
        """Record a committed day's row of metrics (replacing an earlier one): the day is evaluated."""
        if not self.committed(date):
            raise ValueError(f"day {date} is not committed to {self.root}: only a committed day is evaluated")
        days = [d | {"evaluation": row} if d["date"] == date else d for d in self.manifest["days"]]
        self._publish(days, next_id=self.manifest["next_id"], bump=False)

    def checksum(self, as_of: str | None = None) -> str:
        """A hash of what Θ reads as of the end of day `as_of` (None: the latest): its days' shards
        (their files' own checksums), the calibration and the calibrator file; it changes when any of
        them does (a forgotten article, a recalibration)."""
        days = [(d.date, d.shard, d.entries, d.checksums) for d in self.days if as_of is None or d.date <= as_of]
        theta = self.theta_at(as_of)
        calibrator = self.root / theta["dir"] / "calibrator.pt" if theta.get("dir") else None
        parts = [days, theta, checksum(calibrator) if calibrator and calibrator.exists() else None]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def theta_at(self, as_of: str | None = None) -> dict:
        """Θ's settings as of the end of day `as_of` (None: the latest)."""
        thetas = [t for t in self.manifest["thetas"] if as_of is None or t["date"] <= as_of]
        return thetas[-1] if thetas else {}

    def _rewrite(self, rec: dict, keep: np.ndarray | None, drop_docs: set[str] = frozenset()) -> dict:
        """A new shard holding the kept entries of `rec`'s shard (keep None: none, nor its text) and its
        articles but `drop_docs`': its name and checksums."""
        old = rec["shard"]
        n = len(self.shard(old, "values"))
        text = {} if keep is None else articles.without({p.stem: np.load(p) for p in (self.root / "shards" / old).glob(
            "*.npy") if p.stem not in DTYPES and p.stem != WEIGHTS}, drop_docs)
        keep = np.zeros(n, bool) if keep is None else keep
        per_entry = [*DTYPES, WEIGHTS] if self.has_array(old, WEIGHTS) else list(DTYPES)
        arrays = {a: np.asarray(self.shard(old, a))[keep] for a in per_entry} | text
        name = f"{old.rsplit('-', 1)[0]}-{uuid.uuid4().hex[:8]}"
        return {"shard": name, "checksums": self._write_shard(name, arrays, self.shard_docs(old), self.shard_titles(old))}

    def _write_shard(self, name: str, arrays: dict[str, np.ndarray], docs: list[str],
                     titles: list[str] | None = None) -> dict[str, str]:
        """Write a shard folder atomically; the sha256 of each of its files."""
        with replacing(self.root / "shards" / name) as tmp:
            tmp.mkdir()
            for key, arr in arrays.items():
                np.save(tmp / f"{key}.npy", arr)
            (tmp / "docs.json").write_text(json.dumps(docs))
            if titles is not None:
                (tmp / "titles.json").write_text(json.dumps(titles))
            return {p.name: checksum(p) for p in sorted(tmp.iterdir())}

    def _publish(self, days: list[dict], next_id: int, theta: dict | None = None, bump: bool = True) -> None:
        """Commit: the manifest rename is the single step that makes a change visible.

        The version counts changes to the entries (what the index must follow).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = dict(self.manifest, days=days, next_id=next_id, version=self.version + bump,
                        entries=sum(d["entries"] for d in days))
        if theta is not None:
            manifest["thetas"] = [t for t in manifest["thetas"] if t["date"] != theta["date"]] + [theta]
        write_json(self.root / "manifest.json", manifest)
        self.manifest = manifest
        self._values = self._weights = None
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Remove the shard and calibration folders the manifest no longer names (replaced, uncommitted,
        or left by a crash)."""
        live = {d["shard"] for d in self.manifest["days"]} | {t["dir"] for t in self.manifest["thetas"] if "dir" in t}
        for path in [*(self.root / "shards").glob("*"), *(self.root / "theta").glob("*")]:
            if f"{path.parent.name}/{path.name}" not in live and path.name not in live:
                shutil.rmtree(path, ignore_errors=True)
