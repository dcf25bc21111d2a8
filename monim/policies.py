"""Memorization policies: which of a day's tokens enter memory (FullMem, RandMem, MoNIM, AMT, KL,
Greedy Merging)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from typing import TYPE_CHECKING

from monim.datastore import Entries
from monim.knnlm import ThetaScores
from monim.lm import LM
from monim.merging import greedy_merge
from monim.scoring import TokenScores

if TYPE_CHECKING:
    from monim.memory import Memory


def amt_threshold(delta: float, margin: np.ndarray) -> np.ndarray:
    """The adaptive memorization threshold δ / (max_y log P(y)/P(x_t) + 0.5).

    margin = max_y log P(y|x<t;Θ) - log P(x_t|x<t;Θ) >= 0: 2δ when x_t is already top-1 (harder
    to store), closer to 0 for a large margin (easier to store).
    """
    return delta / (np.maximum(margin, 0.0) + 0.5)


LAM_SLACK = 1e-6  # λ_max is widened by this: a calibrator's float32 λ may round just above its ceiling
RULE_SLACK = 1e-9  # and a certain token must clear δ by this: Θ's own rounding cannot flip it


def theta_box(logp: np.ndarray, max_logp: np.ndarray, lam_max: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(L_lo, L_hi, M_lo, M_hi): where L = log P_Θ(x_t) and M = max_y log P_Θ(y) can lie for any
    Θ = (1-λ)·P_LM + λ·P_kNN with λ <= lam_max and any P_kNN, from the LM's log p and log m.

    L = log((1-λ)p + λ·q_t) is least with q_t = 0, greatest with q_t = 1 (λ + (1-λ)p grows with λ);
    M >= log((1-λ)m) (the LM's top token keeps (1-λ)m) and M >= L; M <= log(λ + (1-λ)m). M_lo is given
    at L = L_hi (the store corner); M_hi is at least L_lo (the rule reads max(M - L, 0)).
    """
    lam = min(1.0, lam_max + LAM_SLACK)
    lp, lm = np.asarray(logp, np.float64), np.asarray(max_logp, np.float64)
    with np.errstate(divide="ignore"):
        kept, log_lam = np.log1p(-lam), np.log(lam)
    l_lo, l_hi = kept + lp, np.logaddexp(log_lam, kept + lp)
    return l_lo, l_hi, np.maximum(kept + lm, l_hi), np.maximum(np.logaddexp(log_lam, kept + lm), l_lo)


class Stores:
    """What every policy does once its day's tokens are chosen: nothing (Greedy Merging merges them)."""

    def finish(self, memory: Memory, entries: Entries, rng: np.random.Generator
               ) -> tuple[Entries, np.ndarray | None, np.ndarray | None]:
        """The day's entries to commit, their weights and the ids of older entries they absorbed (None: none)."""
        return entries, None, None


@dataclass
class FullMem(Stores):
    """Store every training token (the classic kNN-LM datastore)."""

    name = "fullmem"
    uses_theta = False

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return np.ones(len(batch), dtype=bool)


@dataclass
class RandMem(Stores):
    """Store a random `rate` of the tokens (seeded by the run's seed and the day)."""

    rate: float = 0.5
    name = "randmem"
    uses_theta = False

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return rng.random(len(batch)) < self.rate


@dataclass
class MoNIM(Stores):
    """Store x_t iff log P(x_t|x<t;Θ) < δ (fixed), or < δ_ada with the adaptive threshold (AMT)."""

    delta: float = -1.5
    adaptive: bool = True
    uses_theta = True  # its rule reads the semiparametric model's prediction

    @property
    def name(self) -> str:
        return "monim-amt" if self.adaptive else "monim"

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        threshold = amt_threshold(self.delta, theta.max_logp - theta.logp) if self.adaptive else self.delta
        return theta.logp < threshold

    def decided(self, logp: np.ndarray, max_logp: np.ndarray, lam_max: float) -> tuple[np.ndarray, np.ndarray]:
        """(stored for sure, skipped for sure) per token, whatever the memory holds, from the LM's
        log p and max log p and the largest λ Θ may give (monim.memory.Memory.lam_max).

        The rule is monotone on L <= M <= 0: AMT stores iff g(L, M) = L·(M - L + 0.5) < δ, where
        ∂g/∂L = M - 2L + 0.5 >= 0.5 - L > 0 and ∂g/∂M = L <= 0 (the fixed rule reads L alone), so it
        decides the same everywhere in the box (monim.policies.theta_box) iff it does at the corner
        where g is greatest (L_hi, M_lo) and at the one where it is least (L_lo, M_hi).
        """
        l_lo, l_hi, m_lo, m_hi = theta_box(logp, max_logp, lam_max)
        if not self.adaptive:
            return l_hi < self.delta - RULE_SLACK, l_lo >= self.delta + RULE_SLACK
        g = lambda l, m: l * (m - l + 0.5)  # noqa: E731
        return g(l_hi, m_lo) < self.delta - RULE_SLACK, g(l_lo, m_hi) >= self.delta + RULE_SLACK

    def certain(self, logp: np.ndarray, max_logp: np.ndarray, lam_max: float) -> np.ndarray:
        """Whether each token's decision is the same under every Θ with λ <= lam_max (see `decided`).

        Why: the LM alone (λ = 0) is one of those Θs, so a certain token need not be searched at all:
        left with no neighbours (Θ = the LM for it) it is stored or skipped exactly as if searched.
        """
        store, skip = self.decided(logp, max_logp, lam_max)
        return store | skip


@dataclass
class KL(Stores):
    """Store the `rate` of tokens whose key carries most new information (appendix strategy).

    Score: KL(one-hot(x_t) || softmax(E·key)) = -log softmax(E·key)[x_t], the key projected
    through the unembedding E; the highest-scoring `rate` of each scored batch is stored.
    """

    rate: float = 0.5
    name = "kl"
    uses_theta = False

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        kl = key_surprisal(lm, batch.key, batch.target)
        return kl >= np.quantile(kl, 1.0 - self.rate)


@torch.inference_mode()
def key_surprisal(lm: LM, keys: np.ndarray, targets: np.ndarray, chunk: int = 256) -> np.ndarray:
    """-log softmax(E·key)[target] for each key, projecting `chunk` keys at a time."""
    out = []
    weight = lm.model.get_output_embeddings().weight
    for i in range(0, len(keys), chunk):
        key = torch.from_numpy(keys[i : i + chunk]).to(device=lm.device, dtype=weight.dtype)
        logits = lm.logits(key)
        target = torch.from_numpy(targets[i : i + chunk]).long().to(lm.device)
        out.append((torch.logsumexp(logits, -1) - logits.gather(1, target[:, None])[:, 0]).cpu())
    return torch.cat(out).numpy() if out else np.zeros(0, np.float32)


@dataclass
class GreedyMerge(Stores):
    """Store every token, then merge same-value neighbours into weighted entries (monim.merging)."""

    k: int = 9
    name = "greedy-merge"
    uses_theta = False

    def select(self, batch: TokenScores, theta: ThetaScores, lm: LM, rng: np.random.Generator) -> np.ndarray:
        return np.ones(len(batch), dtype=bool)

    def finish(self, memory: Memory, entries: Entries, rng: np.random.Generator
               ) -> tuple[Entries, np.ndarray | None, np.ndarray | None]:
        keep, weights, merged = greedy_merge(memory, entries, self.k, rng)
        return entries.take(keep), weights, merged


Policy = FullMem | RandMem | MoNIM | KL | GreedyMerge


def policy_params(policy: Policy) -> dict:
    """The policy's parameters, as recorded in the manifest and in experiment trackers."""
    return asdict(policy)
