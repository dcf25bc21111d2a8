"""How a policy decides a day's tokens with the memory: which tokens it searches the memory for, and
what leaving the others to the LM costs (measured on probes). A policy that reads no Θ searches
nothing (Decision); MoNIM searches only the tokens whose decision the memory can change
(monim.learning.policies.MoNIM.certain) and that it does not leave to the LM alone (MoNIM.settled;
one in PROBE_EVERY of those searched all the same, to measure the error)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from monim.core.config import PROBE_EVERY
from monim.storage.lexical import LexicalCounts, context_grams

if TYPE_CHECKING:
    from monim.lm.token_scores import TokenScores
    from monim.theta.memory import Memory


class Rule(Protocol):
    """What a searching decision asks its policy (monim.learning.policies.MoNIM)."""

    search_context: bool

    def certain(self, logp: np.ndarray, max_logp: np.ndarray, lam_max: float) -> np.ndarray: ...

    def settled(self, logp: np.ndarray, max_logp: np.ndarray, seen: np.ndarray) -> np.ndarray: ...

    def lm_stores(self, logp: np.ndarray, max_logp: np.ndarray) -> np.ndarray: ...


class Decision:
    """A policy that decides without the memory: no token searched, nothing left to the LM to count."""

    search: Callable | None = None  # the memory's search for a batch of tokens (the LM's hook), or None
    settled = probed = probe_flipped = 0

    def count(self, batch: TokenScores, keep: np.ndarray) -> None:
        """Count what the decision of a searched batch left to the LM alone, and the probes' errors."""


class Contexts:
    """Whether each of a day's training tokens has its context (monim.storage.lexical.context_grams) in the
    memorized text, looked up once for the day (the memory does not change while the day is
    memorized); every token counts as seen where the policy reads no contexts (`known` None)."""

    def __init__(self, docs: list, tokens: list[list[int]], known: LexicalCounts | None):
        self.held = None
        if known is not None and tokens:
            self.start = dict(zip((d.id for d in docs), np.cumsum([0, *map(len, tokens)])))
            self.held = known.seen(np.concatenate([context_grams(t) for t in tokens]))

    def seen(self, batch) -> np.ndarray:
        if self.held is None:
            return np.ones(len(batch), bool)
        return self.held[np.fromiter((self.start[d] for d in batch.doc_id), np.int64, len(batch)) + batch.position]


def probes(batch) -> np.ndarray:
    return batch.position % PROBE_EVERY == 0


class Searching(Decision):
    """A policy that reads Θ: every token searched (`skip` off), or only those whose decision the memory
    can change and the policy does not leave to the LM alone, the others decided by the LM alone
    (exactly as Θ would decide the certain ones)."""

    def __init__(self, policy: Rule, memory: Memory, docs: list, tokens: list[list[int]], search: Callable, skip: bool):
        self.policy, self.skip = policy, skip
        self.contexts = Contexts(docs, tokens, memory.lexical() if skip and policy.search_context else None)
        lam_max = memory.lam_max

        def search_uncertain(batch):
            settled = policy.settled(batch.logp, batch.max_logp, self.contexts.seen(batch)) & ~probes(batch)
            return search(batch, wanted=~policy.certain(batch.logp, batch.max_logp, lam_max) & ~settled)

        self.search = search_uncertain if skip else search

    def count(self, batch: TokenScores, keep: np.ndarray) -> None:
        if not self.skip:
            return
        left = self.policy.settled(batch.logp, batch.max_logp, self.contexts.seen(batch))
        probed = left & probes(batch)
        flipped = probed & (keep != self.policy.lm_stores(batch.logp, batch.max_logp))
        self.settled += int(left.sum())
        self.probed += int(probed.sum())
        self.probe_flipped += int(flipped.sum())
