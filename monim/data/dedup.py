"""Near-duplicate articles: the same story under another URL, found by MinHash LSH (datasketch).

Two articles are twins when more than `containment` of the smaller one's word 8-grams occur in the
other (shared/data's definition). MinHash signatures estimate Jaccard similarity; LSH at a low
Jaccard threshold gives candidates, and the containment estimated from Jaccard and the two
shingle counts decides. A day's twins stay in one split (monim.data.day); a memory keeps the
signatures of the articles it learned, so evaluation can tell copied text from new text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:  # datasketch imports scipy (~0.5 s): imported where signatures are made or matched
    from datasketch import MinHash

SHINGLE = 8  # words per shingle
NUM_PERM = 128
SCHEME = "affine32"  # datasketch 2 default, named: stored signatures must be read back with it
CANDIDATE_JACCARD = 0.05  # LSH threshold for candidates (a containment of 0.5 can mean a Jaccard of 0.1)
CONTAINMENT = 0.5
TWINS = ("twin_hashes", "twin_sizes")  # the arrays a memory's day shard keeps them in


@dataclass
class Signatures:
    """MinHash signatures [n, NUM_PERM] (uint32) of n texts and their shingle counts."""

    hashes: np.ndarray
    sizes: np.ndarray  # int64: distinct shingles per text

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def of(cls, texts: Iterable[str]) -> Signatures:
        return cls.of_shingles([shingles(t) for t in texts])

    @classmethod
    def of_shingles(cls, sets: list[set[bytes]]) -> Signatures:
        from datasketch import MinHash

        sketches = MinHash.bulk(sets, num_perm=NUM_PERM, scheme=SCHEME)
        return cls(np.array([m.hashvalues for m in sketches], np.uint32).reshape(len(sets), NUM_PERM),
                   np.array([len(s) for s in sets], np.int64))

    @classmethod
    def concat(cls, parts: Sequence[Signatures]) -> Signatures:
        if not parts:
            return cls(np.zeros((0, NUM_PERM), np.uint32), np.zeros(0, np.int64))
        return cls(np.concatenate([p.hashes for p in parts]), np.concatenate([p.sizes for p in parts]))

    def arrays(self) -> dict[str, np.ndarray]:
        """As arrays kept in a memory's day shard (beside its lexical counts)."""
        return dict(zip(TWINS, (self.hashes, self.sizes)))

    def sketch(self, i: int) -> MinHash:
        from datasketch import MinHash

        return MinHash(num_perm=NUM_PERM, hashvalues=self.hashes[i], scheme=SCHEME)


def shingles(text: str) -> set[bytes]:
    """The distinct lower-cased word 8-grams of a text (the whole text when it is shorter)."""
    words = text.lower().split()
    return {" ".join(words[i : i + SHINGLE]).encode() for i in range(max(1, len(words) - SHINGLE + 1))}


def containment(a: Signatures, i: int, b: Signatures, j: int) -> float:
    """Estimated share of the smaller text's shingles found in the other: J·|A∪B| / min(|A|, |B|)."""
    jac = float((a.hashes[i] == b.hashes[j]).mean())
    union = (a.sizes[i] + b.sizes[j]) / (1.0 + jac)
    return jac * union / max(1, min(a.sizes[i], b.sizes[j]))


class TwinIndex:
    """LSH over a set of articles' signatures: which of them a new article is a twin of."""

    def __init__(self, sigs: Signatures, threshold: float = CONTAINMENT):
        self.sigs, self.threshold = sigs, threshold
        from datasketch import MinHashLSH

        self.lsh = MinHashLSH(threshold=CANDIDATE_JACCARD, num_perm=NUM_PERM)
        for i in range(len(sigs)):
            self.lsh.insert(i, sigs.sketch(i), check_duplication=False)

    def candidates(self, other: Signatures, j: int) -> list[int]:
        """The indexed articles that LSH finds similar to article j of `other`."""
        return sorted(self.lsh.query(other.sketch(j)))

    def twins(self, other: Signatures, j: int) -> list[int]:
        """The indexed articles that article j of `other` is a twin of (containment estimated)."""
        return [i for i in self.candidates(other, j) if containment(self.sigs, i, other, j) >= self.threshold]

    def has_twin(self, other: Signatures) -> np.ndarray:
        """bool [len(other)]: whether each article has a twin among the indexed ones."""
        return np.array([bool(self.twins(other, j)) for j in range(len(other))], bool)


def twin_groups(texts: Sequence[str], threshold: float = CONTAINMENT) -> list[int]:
    """A group label per text: twins (and twins of twins) share the label of their first text.
    LSH proposes the pairs; their exact shingle containment decides."""
    sets = [shingles(t) for t in texts]
    sigs = Signatures.of_shingles(sets)
    index = TwinIndex(sigs, threshold)
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for j in range(len(texts)):
        for i in index.candidates(sigs, j):
            if i == j or len(sets[i] & sets[j]) < threshold * min(len(sets[i]), len(sets[j])):
                continue
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)
    return [root(i) for i in range(len(texts))]
