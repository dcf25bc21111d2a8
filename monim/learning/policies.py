"""Memorization policies: which of a day's tokens enter memory (FullMem, RandMem, MoNIM, AMT, KL,
Greedy Merging; In-Context RALM, none)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from monim.core import catalogue
from monim.core.catalogue import MEMORY
from monim.core.config import PolicyConfig
from monim.learning.decision import Decision, Searching
from monim.learning.merging import greedy_merge
from monim.learning.threshold import amt_threshold, certain, decided, lm_slack
from monim.storage.entries import Entries

if TYPE_CHECKING:  # a policy's rule reads numbers: torch only where KL projects keys (key_surprisal)
    from monim.core.run_config import RunConfig
    from monim.lm.model import LM
    from monim.lm.token_scores import TokenScores
    from monim.theta.knnlm import ThetaScores
    from monim.theta.memory import Memory


@dataclass
class Policy:
    """A memorization policy: which of a day's tokens enter memory (`select`), decided without the
    memory (`decision`: MoNIM's reads Θ), and what it does once they are chosen (`finish`: nothing;
    Greedy Merging merges them)."""

    stores = True  # it chooses among the day's tokens (In-Context RALM stores none: it keeps the articles)

    @property
    def name(self) -> str:
        """The run's name for it (monim.core.catalogue)."""
        raise NotImplementedError

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        """Whether each token of a scored batch enters memory."""
        raise NotImplementedError

    def decision(self, memory: Memory, docs: list, tokens: list[list[int]], search: Callable, skip: bool) -> Decision:
        """How the day's tokens are decided with the memory (monim.learning.decision): without it."""
        return Decision()

    def finish(self, memory: Memory, entries: Entries, rng: np.random.Generator
               ) -> tuple[Entries, np.ndarray | None, np.ndarray | None]:
        """The day's entries to commit, their weights and the ids of older entries they absorbed (None: none)."""
        return entries, None, None


@dataclass
class FullMem(Policy):
    """Store every training token (the classic kNN-LM datastore)."""

    name = "fullmem"

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return np.ones(len(batch), dtype=bool)


@dataclass
class RandMem(Policy):
    """Store a random `rate` of the tokens (seeded by the run's seed and the day)."""

    rate: float = 0.5
    name = "randmem"

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return rng.random(len(batch)) < self.rate


@dataclass
class MoNIM(Policy):
    """Store x_t iff log P(x_t|x<t;Θ) < δ (fixed), or < δ_ada with the adaptive threshold (AMT)."""

    delta: float = -1.5
    adaptive: bool = True
    search_margin: float | None = None  # see monim.core.config.PolicyConfig (None, False here: every token decided exactly)
    search_context: bool = False
    in_context: bool = False  # Θ reads each scored text with In-Context RALM's article before it (ralm+monim-amt)

    @property
    def name(self) -> str:
        return ("ralm+" if self.in_context else "") + ("monim-amt" if self.adaptive else "monim")

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        threshold = amt_threshold(self.delta, theta.max_logp - theta.logp) if self.adaptive else self.delta
        return theta.logp < threshold

    def decision(self, memory: Memory, docs: list, tokens: list[list[int]], search: Callable, skip: bool) -> Decision:
        """Its rule reads Θ: each token searched, or (`skip`) only where the memory can change its decision."""
        return Searching(self, memory, docs, tokens, search, skip)

    def decided(self, logp: np.ndarray, max_logp: np.ndarray, lam_max: float) -> tuple[np.ndarray, np.ndarray]:
        """(stored for sure, skipped for sure) per token, whatever the memory holds (monim.learning.threshold.decided)."""
        return decided(logp, max_logp, lam_max, self.delta, self.adaptive)

    def certain(self, logp: np.ndarray, max_logp: np.ndarray, lam_max: float) -> np.ndarray:
        """Whether each token's decision is the same under every Θ with λ <= lam_max (monim.learning.threshold.certain)."""
        return certain(logp, max_logp, lam_max, self.delta, self.adaptive)

    def lm_stores(self, logp: np.ndarray, max_logp: np.ndarray) -> np.ndarray:
        """Whether the LM alone (Θ without neighbours) stores each token."""
        return lm_slack(logp, max_logp, self.delta, self.adaptive) < 0

    def settled(self, logp: np.ndarray, max_logp: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Whether each token is left to the LM alone, not searched: it keeps the token out by more
        than `search_margin`, or (`search_context`) stores it and the memory's text lacks its context
        (`seen`: monim.storage.lexical.LexicalCounts.seen), where no neighbour is near enough to unstore it."""
        slack = lm_slack(logp, max_logp, self.delta, self.adaptive)
        out = slack > self.search_margin if self.search_margin is not None else np.zeros(len(slack), bool)
        return out | (slack < 0) & ~seen if self.search_context else out


@dataclass
class InContext(Policy):
    """In-Context RALM (Ram et al., 2023): no entries, the day's articles kept for BM25 (monim.theta.ralm)."""

    name = "ralm"
    stores = False

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(len(batch), dtype=bool)


@dataclass
class KL(Policy):
    """Store the `rate` of tokens whose key carries most new information (appendix strategy).

    Score: KL(one-hot(x_t) || softmax(E·key)) = -log softmax(E·key)[x_t], the key projected
    through the unembedding E; the highest-scoring `rate` of each scored batch is stored.
    """

    rate: float = 0.5
    name = "kl"

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        kl = key_surprisal(lm, batch.key, batch.target)
        return kl >= np.quantile(kl, 1.0 - self.rate)


def key_surprisal(lm: LM, keys: np.ndarray, targets: np.ndarray, chunk: int = 256) -> np.ndarray:
    """-log softmax(E·key)[target] for each key, projecting `chunk` keys at a time."""
    import torch

    out = []
    weight = lm.model.get_output_embeddings().weight
    with torch.inference_mode():
        for i in range(0, len(keys), chunk):
            key = torch.from_numpy(keys[i : i + chunk]).to(device=lm.device, dtype=weight.dtype)
            logits = lm.logits(key)
            target = torch.from_numpy(targets[i : i + chunk]).long().to(lm.device)
            out.append((torch.logsumexp(logits, -1) - logits.gather(1, target[:, None])[:, 0]).cpu())
    return torch.cat(out).numpy() if out else np.zeros(0, np.float32)


@dataclass
class GreedyMerge(Policy):
    """Store every token, then merge same-value neighbours into weighted entries (monim.learning.merging)."""

    k: int = 9
    name = "greedy-merge"

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return np.ones(len(batch), dtype=bool)

    def finish(self, memory: Memory, entries: Entries, rng: np.random.Generator
               ) -> tuple[Entries, np.ndarray | None, np.ndarray | None]:
        keep, weights, merged = greedy_merge(memory, entries, self.k, rng)
        return entries.take(keep), weights, merged


def policy_params(policy: Policy) -> dict:
    """The policy's parameters, as recorded in the manifest and in experiment trackers."""
    return asdict(policy)


def make_policy(name: str, cfg: PolicyConfig | None = None, follows: float | None = None, **changes) -> Policy:
    """A memorization policy by its name (fullmem, randmem, monim, monim-amt, kl, greedy-merge), with
    the parameters it reads from `cfg` and `changes` (PolicyConfig's fields); `follows`: the MemRate it
    stores at where it follows another run (RandMem, unless a rate is set)."""
    e = catalogue.policy_info(name)
    if e.make is None:
        raise ValueError(f"{name} is not a memorization policy; expected one of {', '.join(catalogue.names(MEMORY))}")
    cfg = replace(cfg or PolicyConfig(), **changes)
    rate = cfg.rate if cfg.rate is not None else follows if follows is not None and e.follows else catalogue.DEFAULT_RATE
    # each with the PolicyConfig fields its entry reads (ralm_*: Θ's, monim.theta.ralm)
    match e.make:
        case "FullMem":
            return FullMem()
        case "RandMem":
            return RandMem(rate)
        case "KL":
            return KL(rate)
        case "GreedyMerge":
            return GreedyMerge(cfg.merge_k)
        case "MoNIM":
            return MoNIM(cfg.delta, adaptive=e.adaptive, search_margin=cfg.search_margin,
                         search_context=cfg.search_context, in_context=e.in_context)
        case "InContext":
            return InContext()
    raise ValueError(f"{name}: the catalogue names no policy class {e.make}")


def run_policy(cfg: RunConfig) -> Policy:
    """The policy a run learns with: its PolicyConfig, at the MemRate it follows where it follows one."""
    return make_policy(cfg.policy, cfg.policy_config(), cfg.followed_memrate)
