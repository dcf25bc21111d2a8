"""The adaptive memorization threshold (AMT) and where no memory can change its decision: the rule
MoNIM applies to Θ's prediction, and the tokens whose decision the LM's own statistics settle."""

from __future__ import annotations

import numpy as np


def amt_threshold(delta: float, margin: np.ndarray) -> np.ndarray:
    """The adaptive memorization threshold δ / (max_y log P(y)/P(x_t) + 0.5).

    margin = max_y log P(y|x<t;Θ) - log P(x_t|x<t;Θ) >= 0: 2δ when x_t is already top-1 (harder
    to store), closer to 0 for a large margin (easier to store).
    """
    return delta / (np.maximum(margin, 0.0) + 0.5)


def lm_slack(logp: np.ndarray, max_logp: np.ndarray, delta: float, adaptive: bool = True) -> np.ndarray:
    """How far the LM alone keeps each token out of memory: g(L, M) - δ under AMT (L·(M - L + 0.5)
    - δ), L - δ under the fixed rule; > 0: not stored. Memory rarely flips a token with a large slack
    (one held-out day: 15 of 29,870 tokens above 1.0), which MoNIM's `search_margin` reads."""
    lp, lm = np.asarray(logp, np.float64), np.asarray(max_logp, np.float64)
    return (lp * (np.maximum(lm - lp, 0.0) + 0.5) if adaptive else lp) - delta


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


def decided(logp: np.ndarray, max_logp: np.ndarray, lam_max: float, delta: float, adaptive: bool = True
            ) -> tuple[np.ndarray, np.ndarray]:
    """(stored for sure, skipped for sure) per token, whatever the memory holds, from the LM's
    log p and max log p and the largest λ Θ may give (monim.theta.memory.Memory.lam_max).

    The rule is monotone on L <= M <= 0: AMT stores iff g(L, M) = L·(M - L + 0.5) < δ, where
    ∂g/∂L = M - 2L + 0.5 >= 0.5 - L > 0 and ∂g/∂M = L <= 0 (the fixed rule reads L alone), so it
    decides the same everywhere in the box (`theta_box`) iff it does at the corner where g is
    greatest (L_hi, M_lo) and at the one where it is least (L_lo, M_hi).
    """
    l_lo, l_hi, m_lo, m_hi = theta_box(logp, max_logp, lam_max)
    if not adaptive:
        return l_hi < delta - RULE_SLACK, l_lo >= delta + RULE_SLACK
    g = lambda L, M: L * (M - L + 0.5)  # noqa: E731
    return g(l_hi, m_lo) < delta - RULE_SLACK, g(l_lo, m_hi) >= delta + RULE_SLACK


def certain(logp: np.ndarray, max_logp: np.ndarray, lam_max: float, delta: float, adaptive: bool = True) -> np.ndarray:
    """Whether each token's decision is the same under every Θ with λ <= lam_max (see `decided`).

    Why: the LM alone (λ = 0) is one of those Θs, so a certain token need not be searched at all:
    left with no neighbours (Θ = the LM for it) it is stored or skipped exactly as if searched.
    """
    store, skip = decided(logp, max_logp, lam_max, delta, adaptive)
    return store | skip
