"""A streaming day: its articles split 98/1/1 into train, validation and test, and what reading it counted."""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from monim.data import dedup
from monim.data.feed import Document

SPLITS = ("train", "validation", "test")
READ = ("train", "validation", "test", "duplicates", "capped", "forgotten")  # the counts that add up to a day's articles in the feed
COUNTED = (*READ, "skipped", "late")  # the counts that add up to every record a day read, each in one


@dataclass
class Day:
    """One streaming day, split into train / validation / test documents."""

    date: dt.date
    train: list[Document]
    validation: list[Document]
    test: list[Document]
    skipped: int = 0  # bad records skipped while reading this day (on_error="skip")
    bad: list[str] = field(default_factory=list)  # the first monim.data.stream.NAMED of them, each as its message says it
    duplicates: int = 0  # documents dropped because an earlier one that day had the same text
    groups: dict[str, str] = field(default_factory=dict)  # doc id -> its near-duplicate group (first doc's id)
    capped_out: int = 0  # training articles left out by a cap on articles a day (max_docs)
    truncated: int = 0  # articles cut to a cap on tokens an article
    titles_cut: int = 0  # headlines cut to monim.data.feed.TITLE_CAP characters at ingest
    texts_cut: int = 0  # articles cut to monim.data.feed.TEXT_CAP characters at ingest
    late: list[tuple[str, str]] = field(default_factory=list)  # (id, date) of late records read with the day, not learned
    ids: tuple[str, ...] = ()  # every article's id the day read (repeats and capped ones too): what a memory knows
    forgotten: list[tuple[str, str]] = field(default_factory=list)  # (id, why) of articles a memory forgot, read and not learned

    @property
    def twin_groups(self) -> int:
        """Near-duplicate groups of two or more articles this day (monim.data.dedup)."""
        return sum(n > 1 for n in Counter(self.groups.values()).values())

    def capped(self, max_docs: int | None) -> Day:
        """The day with its first `max_docs` training articles only (None: all); the rest are counted in `capped`."""
        if max_docs is None or len(self.train) <= max_docs:
            return self
        return replace(self, train=self.train[:max_docs], capped_out=self.capped_out + len(self.train) - max_docs)

    def truncate(self, max_tokens: int | None, cut: Callable[[str, int], str | None]) -> Day:
        """The day with every article longer than `max_tokens` tokens cut to them (`cut(text, n)`: its
        first n tokens), counted in `truncated`."""
        if max_tokens is None:
            return self
        long = {d.id for split in SPLITS for d in self.split(split) if len(d.text) > max_tokens}  # a token has a character
        cuts = {d.id: text for split in SPLITS for d in self.split(split)
                if d.id in long and (text := cut(d.text, max_tokens)) is not None}

        def shorter(docs: list[Document]) -> list[Document]:
            return [replace(d, text=cuts[d.id]) if d.id in cuts else d for d in docs]

        return replace(self, train=shorter(self.train), validation=shorter(self.validation), test=shorter(self.test),
                       truncated=self.truncated + len(cuts))

    def without(self, forgotten: Mapping[str, str], prints: dedup.Signatures) -> Day:
        """The day without the articles a memory forgot: by id (id -> the day it was forgotten from), or a
        near-duplicate of one (`prints`: their signatures); each named, with why, in `forgotten`."""
        docs = [d for split in SPLITS for d in self.split(split)]
        twins = dedup.TwinIndex(prints).has_twin(dedup.Signatures.of([d.text for d in docs])) if len(prints) and docs \
            else [False] * len(docs)
        why = {d.id: f"forgotten ({forgotten[d.id]})" if d.id in forgotten else "a near-duplicate of a forgotten article"
               for d, twin in zip(docs, twins) if d.id in forgotten or twin}
        if not why:
            return self
        kept = {s: [d for d in self.split(s) if d.id not in why] for s in SPLITS}
        return replace(self, train=kept["train"], validation=kept["validation"], test=kept["test"], forgotten=self.forgotten + list(why.items()), ids=tuple(i for i in self.ids if i not in why))

    def split(self, name: str) -> list[Document]:
        """The documents of one split by name."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
        return getattr(self, name)

    def __len__(self) -> int:
        return len(self.train) + len(self.validation) + len(self.test)

    def counts(self) -> dict[str, int]:
        """Articles per split, what reading the day dropped, skipped or grouped, and the records it read
        (`records`: each in exactly one of the counts named in COUNTED)."""
        counts = {"train": len(self.train), "validation": len(self.validation), "test": len(self.test),
                  "skipped": self.skipped, "duplicates": self.duplicates, "twin_groups": self.twin_groups,
                  "capped": self.capped_out, "truncated": self.truncated, "titles_cut": self.titles_cut,
                  "texts_cut": self.texts_cut, "late": len(self.late), "forgotten": len(self.forgotten)}
        return counts | {"records": records(counts)}


def _rank(seed: int, doc_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()


def split_day(docs: list[Document], seed: int = 0, heldout: float = 0.01,
              groups: list[int] | None = None) -> tuple[list, list, list]:
    """Train / validation / test: the groups whose hash of (seed, first doc's id) ranks lowest are
    held out, a near-duplicate group (`groups`: a label per doc) always whole in one split.

    Each held-out split takes `heldout` of the day (1%), and at least one document when the day
    has three or more (a group that does not fit goes to train, unless the split is still empty);
    documents keep their source order within a split.
    """
    k = max(1, round(heldout * len(docs))) if len(docs) >= 3 else 0
    labels = list(range(len(docs))) if groups is None else groups
    members: dict[int, list[int]] = {}
    for i, g in enumerate(labels):
        members.setdefault(g, []).append(i)
    ranked = sorted(members.values(), key=lambda m: _rank(seed, docs[m[0]].id))
    role: dict[int, str] = {}
    room = {"validation": k, "test": k}
    for group in ranked:
        split = next((s for s, r in room.items() if r > 0 and (len(group) <= r or r == k)), None)
        if split is None:
            continue
        room[split] -= len(group)
        role |= {i: split for i in group}
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for i, doc in enumerate(docs):
        out[role.get(i, "train")].append(doc)
    return out["train"], out["validation"], out["test"]


def records(counts: dict, prefix: str = "") -> int:
    """How many records a day read, from its counts (or a run's row: keys with `prefix`)."""
    return sum(counts.get(prefix + k, 0) for k in COUNTED)


def articles(counts: dict, prefix: str = "") -> int:
    """How many articles a day had in the feed, from its counts() (or a run's row: keys with `prefix`)."""
    return sum(counts.get(prefix + k, 0) for k in READ)
