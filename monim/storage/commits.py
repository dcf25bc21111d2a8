"""A datastore's writes, each published by one manifest rename: a day committed atomically
(idempotent), a forget (for good: monim.storage.forgotten), a relearn, Θ's settings, a day's
evaluation, and the garbage a crash left removed. A Datastore owns one; its caller holds the memory's lock.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import uuid
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from monim.core.atomic import checksum, replacing, write_json
from monim.core.manifest import CommittedDay
from monim.data.dedup import TWINS, Signatures
from monim.data.feed import Document
from monim.storage import articles, forgotten, lexical
from monim.storage.entries import DTYPES, Entries
from monim.storage.shards import WEIGHTS, Shards

Retext = Callable[[list[Document]], dict[str, np.ndarray]]  # a day's text arrays from its articles (articles.day_text)
TEXT = (*lexical.TEXT_ARRAYS, lexical.GRAMS, *TWINS, articles.ARRAY, articles.SEEN)  # a day's text arrays: none per entry


class Commits:
    """A datastore's writes, each published by one manifest rename that its shards then follow."""

    def __init__(self, shards: Shards):
        self.shards = shards
        self.root = shards.root

    @property
    def manifest(self) -> dict:
        """The manifest as last published (what every write changes)."""
        return self.shards.manifest

    def commit_day(self, date: dt.date | str, entries: Entries, tokens_seen: int, policy: str,
                   params: dict | None = None, force: bool = False, text: dict[str, np.ndarray] | None = None,
                   titles: dict[str, str] | None = None, weights: np.ndarray | None = None,
                   merged: np.ndarray | None = None, searched: int = 0) -> bool:
        """Append one day's entries atomically; False (no change) if the day is already committed.

        With force, a committed day is replaced, but only if it is the last one. `text`: arrays
        describing the day's training text (monim.storage.lexical.day_counts), kept in the day's shard;
        `titles`: the documents' headlines (doc id -> title), shown as sources. Greedy Merging:
        `weights` of the entries, and the ids of older entries they absorbed (`merged`), removed
        from their shards in the same commit. `searched`: training tokens the day's decision searched.
        A day the memory forgot is refused (monim.storage.forgotten.ForgottenDay) until relearned by name.
        """
        date = str(date)
        days = list(self.manifest["days"])
        if self.shards.committed(date):
            if not force:
                return False
            if days[-1]["date"] != date:
                raise ValueError(f"day {date} is committed and is not the last day ({days[-1]['date']}): "
                                 "only the last day can be replaced")
            days.pop()
        else:
            self.appendable(date)
        if len(entries) and entries.keys.shape[1] != self.manifest["hidden_size"]:
            raise ValueError(f"keys have {entries.keys.shape[1]} dims, memory has {self.manifest['hidden_size']}")

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
        days.append(CommittedDay(date, name, int(tokens_seen), len(entries), policy, params or {},
                              searched=int(searched), checksums=sums).__dict__)
        self._publish(days, next_id=next_id + len(entries))
        return True

    def set_theta(self, theta: dict) -> None:
        """Record the semiparametric model's settings (λ, T, date, dir, ...) the next day will score
        with, and add them to Θ's history (a day calibrated again replaces its entry)."""
        self._publish(self.manifest["days"], next_id=self.manifest["next_id"], theta=theta, bump=False)

    def record_evaluation(self, date: str, row: dict) -> None:
        """Record a committed day's row of metrics (replacing an earlier one): the day is evaluated."""
        if not self.shards.committed(date):
            raise ValueError(f"day {date} is not committed to {self.root}: only a committed day is evaluated")
        days = [d | {"evaluation": row} if d["date"] == date else d for d in self.manifest["days"]]
        self._publish(days, next_id=self.manifest["next_id"], bump=False)

    def appendable(self, date: str) -> None:
        """Refuse a day the memory cannot add: one before its last day, or one it forgot (ForgottenDay)."""
        if self.manifest["days"] and date < self.manifest["days"][-1]["date"]:
            raise ValueError(f"day {date} comes before the last committed day {self.manifest['days'][-1]['date']}")
        forgotten.refuse(self.manifest, date)

    def forget(self, doc_ids: list[str] | None = None, days: Sequence[dt.date | str] | None = None,
               reason: str | None = None, retext: Retext | None = None, store: Path | None = None) -> int:
        """Remove the entries of these documents and/or days; returns how many were removed. The last
        committed day, named, is uncommitted: the memory returns to its state before the day (its
        entries, evaluation and calibration gone). Whatever a forget changes is logged in the manifest
        (monim.storage.forgotten, with `reason`): a forgotten day is never learned again unless relearned by name.
        Nothing of what is forgotten stays in the memory's folder: a shard keeps no id, headline, text,
        lexical count or signature of it (`retext` makes a day's text arrays again from the articles it
        keeps; without it they go), and its calibration tokens leave the calibration sets; with `store` (a
        feature store), its features go too (monim.lm.features.forget: by its text, else its day's)."""
        drop_docs, drop_days = set(doc_ids or ()), {str(d) for d in days or ()} - set(forgotten.forgotten_days(self.manifest))
        last = self.manifest["days"][-1]["date"] if self.manifest["days"] else None
        removed, new_days, gone, texts, keys, unkept = 0, [], {}, [], [], set()
        held: dict[str, str] = {}  # a forgotten article -> the day that held it
        for rec in map(dict, self.manifest["days"]):
            if rec["date"] in drop_days:
                removed, gone[rec["date"]] = removed + rec["entries"], self.shards.shard_seen(rec["shard"])
                if rec["date"] == last:  # uncommitted (its ids are not used again: ids stay stable)
                    continue
                rec.update(entries=0, forgotten=rec["forgotten"] + rec["entries"], **self._rewrite(rec, None))
            elif drop_docs:
                docs, names = np.asarray(self.shards.shard(rec["shard"], "docs")), self.shards.shard_docs(rec["shard"])
                keep = ~np.isin(docs, [i for i, d in enumerate(names) if d in drop_docs])
                hit = [a for a in self.shards.shard_articles(rec["shard"]) if a[0] in drop_docs]
                read = set(self.shards.shard_seen(rec["shard"])) & drop_docs
                if not keep.all() or hit or read:
                    removed += int((~keep).sum())
                    held |= {names[i]: rec["date"] for i in np.unique(docs[~keep])} | dict.fromkeys([a[0] for a in hit], rec["date"]) \
                        | dict.fromkeys(read, rec["date"])
                    texts += [a[2] for a in hit]
                    if (read | {names[i] for i in np.unique(docs[~keep])}) - {a[0] for a in hit}:
                        unkept.add(rec["date"])  # a document whose text the day does not keep (held out)
                    keys.append(np.asarray(self.shards.shard(rec["shard"], "keys"))[~keep])
                    rec.update(entries=int(keep.sum()), forgotten=rec["forgotten"] + int((~keep).sum()),
                               **self._rewrite(rec, keep, drop_docs, retext))
            new_days.append(rec)
        if gone or held:
            if store is not None:
                from monim.lm.features import digest, forget as forget_features  # torch: only where a store is named

                forget_features(store, {digest(t) for t in texts}, set(gone) | unkept)
            self._purge_calibration(set(gone), set(held) | {i for ids in gone.values() for i in ids}, keys)
            thetas = [t for t in self.manifest["thetas"] if last not in gone or t["date"] != last]
            event = forgotten.forget_event(gone, held, reason, Signatures.of(texts) if texts else None)
            (self.root / lexical.CACHE).unlink(missing_ok=True)  # derived from the shards: made again without them when read
            self._publish(new_days, next_id=self.manifest["next_id"], thetas=thetas,
                          forgotten=[*forgotten.log(self.manifest), event])
        return removed

    def _purge_calibration(self, dates: set[str], doc_ids: set[str], keys: list[np.ndarray]) -> None:
        """The forgotten days' calibration samples removed, and the forgotten articles' tokens from every
        calibration file (by article; in files kept before calibration tokens named theirs, by key)."""
        for date in dates:
            (self.root / "calibration" / f"{date}.npz").unlink(missing_ok=True)
        known = {row.tobytes() for part in keys for row in np.asarray(part, np.float16)}
        for path in [*(self.root / "calibration").glob("*.npz"), *(self.root / "theta").glob("*/examples.npz")]:
            with np.load(path) as f:
                arrays = {k: f[k] for k in f.files}
            if "doc_id" in arrays:
                drop = np.isin(arrays["doc_id"].astype(str), list(doc_ids))
            else:
                drop = np.array([row.tobytes() in known for row in np.asarray(arrays["key"], np.float16)], bool)
            if drop.any():
                with replacing(path) as tmp:
                    np.savez(tmp, **{k: v[~drop] for k, v in arrays.items()})

    def relearn(self, date: str) -> None:
        """Let a day be learned again, asked by name: the last committed day is uncommitted (its entries,
        evaluation and calibration gone), a forgotten one after it no longer refused; logged."""
        forgotten.check_relearn(self.manifest, date)
        days = self.manifest["days"]
        kept = days[:-1] if days and days[-1]["date"] == date else days
        self._publish(kept, next_id=self.manifest["next_id"], bump=len(kept) != len(days),
                      thetas=[t for t in self.manifest["thetas"] if t["date"] != date],
                      forgotten=[*forgotten.log(self.manifest), forgotten.relearn_event(date)])

    def _without(self, rec: dict, merged: np.ndarray) -> dict:
        """A day's record with the merged entry ids removed from its shard (rewritten if any was there)."""
        if not rec["entries"]:
            return rec
        keep = ~np.isin(self.shards.shard(rec["shard"], "ids"), merged)
        if keep.all():
            return rec
        rec = dict(rec, merged=rec.get("merged", 0) + int((~keep).sum()), entries=int(keep.sum()))
        return rec | self._rewrite(rec, keep)

    def _rewrite(self, rec: dict, keep: np.ndarray | None, drop_docs: set[str] | frozenset[str] = frozenset(),
                 retext: Retext | None = None) -> dict:
        """A new shard holding the kept entries of `rec`'s shard (keep None: none, nor its text) without
        `drop_docs` (their ids, headlines and text): its name and checksums."""
        old = rec["shard"]
        n = len(self.shards.shard(old, "values"))
        per_entry = [*DTYPES, WEIGHTS] if self.shards.has_array(old, WEIGHTS) else list(DTYPES)
        arrays = {a: np.asarray(self.shards.shard(old, a))[np.zeros(n, bool) if keep is None else keep] for a in per_entry}
        names, titles = ([], None) if keep is None else (self.shards.shard_docs(old), self.shards.shard_titles(old))
        if keep is not None:
            arrays |= self._text_without({p.stem: np.load(p) for p in (self.root / "shards" / old).glob("*.npy")
                                          if p.stem not in per_entry}, rec["date"], drop_docs, retext)
        if keep is not None and drop_docs:  # the documents left, numbered again: no name of a forgotten one stays
            live = np.unique(arrays["docs"])
            arrays["docs"] = np.searchsorted(live, arrays["docs"]).astype(DTYPES["docs"])
            names, titles = [names[i] for i in live], None if titles is None else [titles[i] for i in live]
        name = f"{old.rsplit('-', 1)[0]}-{uuid.uuid4().hex[:8]}"
        return {"shard": name, "checksums": self._write_shard(name, arrays, names, titles)}

    @staticmethod
    def _text_without(text: dict[str, np.ndarray], date: str, drop_docs: set[str] | frozenset[str], retext: Retext | None) -> dict:
        """A shard's text arrays without these documents: made again from the articles it keeps (`retext`),
        or, where it cannot be (no articles kept, or no `retext`), without the day's text; their ids gone
        from the ids the day read."""
        if not drop_docs:
            return text
        out = {k: v for k, v in text.items() if k not in TEXT}
        if articles.ARRAY in text and retext is not None:
            out |= retext([d for d in articles.documents(text[articles.ARRAY], date) if d.id not in drop_docs])
        if articles.SEEN in text:
            out |= articles.seen([i for i in articles.unpack(text[articles.SEEN]) if i not in drop_docs])
        return out

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

    def _publish(self, days: list[dict], next_id: int, theta: dict | None = None, bump: bool = True, **fields) -> None:
        """Commit: the manifest rename is the single step that makes a change visible (`fields`: the
        manifest's other records changed with it).

        The version counts changes to the entries (what the index must follow).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = dict(self.manifest, **fields, days=days, next_id=next_id, version=self.manifest["version"] + bump,
                        entries=sum(d["entries"] for d in days))
        if theta is not None:
            manifest["thetas"] = [t for t in manifest["thetas"] if t["date"] != theta["date"]] + [theta]
        write_json(self.root / "manifest.json", manifest)
        self.shards.follow(manifest)
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Remove the shard and calibration folders the manifest no longer names (replaced, uncommitted,
        or left by a crash)."""
        live = {d["shard"] for d in self.manifest["days"]} | {t["dir"] for t in self.manifest["thetas"] if "dir" in t}
        for path in [*(self.root / "shards").glob("*"), *(self.root / "theta").glob("*")]:
            if f"{path.parent.name}/{path.name}" not in live and path.name not in live:
                shutil.rmtree(path, ignore_errors=True)
