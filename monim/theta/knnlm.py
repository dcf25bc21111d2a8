"""kNN-LM: the neighbours' next-token distribution and its interpolation with the LM, in log space."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

Array = TypeVar("Array", np.ndarray, torch.Tensor)
LAMBDAS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7)  # 0: Θ is the LM
TEMPERATURES = (0.3, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


def knn_log_weights(dist: torch.Tensor, values: torch.Tensor, temperature: float,
                    prior: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(-d/T + log prior) over each row's neighbours; missing neighbours (value -1) get -inf."""
    scores = -dist.double() / temperature + (0.0 if prior is None else prior.double())
    scores = scores.masked_fill(values < 0, -math.inf)
    logw = torch.log_softmax(scores, dim=-1)
    return torch.nan_to_num(logw, nan=-math.inf, neginf=-math.inf)  # NaN: a row with no neighbour


def knn_target_logprob(logw: torch.Tensor, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log p_kNN(target): logsumexp of the weights of neighbours whose value is the target."""
    return torch.logsumexp(logw.masked_fill(values != target[:, None], -math.inf), dim=-1)


def knn_full_probs(logw: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """p_kNN over the whole vocabulary [n, V]: the weights of neighbours sharing a value summed."""
    probs = torch.zeros(len(values), vocab_size, dtype=logw.dtype, device=logw.device)
    return probs.scatter_add_(1, values.clamp(min=0).long(), logw.exp())  # missing ones weigh 0


def knn_value_probs(logw: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """p_kNN of each neighbour's own value [n, k]: the weights of the row's neighbours sharing it
    summed (a sort per row, not a [n, V] buffer); missing neighbours weigh 0."""
    sorted_values, order = values.clamp(min=0).sort(dim=1, stable=True)
    start = torch.ones_like(sorted_values, dtype=torch.bool)
    start[:, 1:] = sorted_values[:, 1:] != sorted_values[:, :-1]
    run = start.cumsum(1) - 1  # each sorted neighbour's run of equal values
    sums = torch.zeros_like(logw).scatter_add_(1, run, logw.exp().gather(1, order))
    return torch.empty_like(sums).scatter_(1, order, sums.gather(1, run))


def knn_full_logprobs(logw: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p_kNN over the whole vocabulary [n, V] (for next-word prediction and generation)."""
    return knn_full_probs(logw, values, vocab_size).log()


def interpolate(lm_logp: torch.Tensor, knn_logp: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    """log((1-λ) p_LM + λ p_kNN), computed in log space; λ is a number or one per row."""
    lam = torch.as_tensor(lam, dtype=torch.float64)
    if lam.dim() == 1:
        lam = lam.view(-1, *([1] * (lm_logp.dim() - 1)))
    return torch.logaddexp(torch.log1p(-lam) + lm_logp.double(), torch.log(lam) + knn_logp.double())


@dataclass
class Interpolation:
    """The semiparametric model's constant-λ settings."""

    lam: float = 0.25
    temperature: float = 1.0


@dataclass
class ThetaScores:
    """Per token under LM + memory: log P(target), max_y log P(y) and the top-1 token."""

    logp: np.ndarray
    max_logp: np.ndarray
    argmax: np.ndarray


def row_lam(knn_values: np.ndarray | torch.Tensor, lam: float | np.ndarray | torch.Tensor) -> torch.Tensor:
    """λ per row: `lam` (a number or one per row), 0 for rows without any neighbour (LM alone); on
    the device of `knn_values` where they are a tensor."""
    has = torch.as_tensor(knn_values[:, 0] >= 0)
    return torch.where(has, torch.as_tensor(lam, dtype=torch.float64, device=has.device), 0.0).double()


def theta_logprobs(lm_logp: torch.Tensor, dist: torch.Tensor, values: torch.Tensor, prior: torch.Tensor | None,
                   lams: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Θ's log P over the vocabulary [n, V] of searched rows, from the LM's (`lm_logp` [n, V]; λ per row:
    `row_lam`), and each neighbour's log kNN weight [n, k] (tensors on one device)."""
    values = values.long()
    logw = knn_log_weights(dist, values, temperature, prior)
    return interpolate(lm_logp, knn_full_logprobs(logw, values, lm_logp.shape[-1]), lams), logw


def theta_of(logp: torch.Tensor, max_logp: torch.Tensor, top: torch.Tensor, target: torch.Tensor, dist: torch.Tensor,
             values: torch.Tensor, lm_logp_values: torch.Tensor, prior: torch.Tensor | None, lams: torch.Tensor,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Θ's log P(target), max log P and top-1 of rows of a searched batch (tensors on one device; λ
    per row: `row_lam`): the maximum lies at the LM's top token or at a neighbour's value, so only
    those candidates are evaluated (exactly, from the full kNN distribution)."""
    values, target, top = values.long(), target.long(), top.long()
    logw = knn_log_weights(dist, values, temperature, prior)
    target_logp = interpolate(logp, knn_target_logprob(logw, values, target), lams)
    cand_ids = torch.cat([top[:, None], values.clamp(min=0)], dim=1)
    cand_lm = torch.cat([max_logp[:, None], lm_logp_values], 1)
    cand_knn = torch.cat([knn_target_logprob(logw, values, top)[:, None], knn_value_probs(logw, values).log()], 1)
    cand = interpolate(cand_lm, cand_knn, lams)
    cand[:, 1:] = cand[:, 1:].masked_fill(values < 0, -math.inf)
    best = cand.argmax(dim=1)
    return target_logp, cand.gather(1, best[:, None])[:, 0], cand_ids.gather(1, best[:, None])[:, 0]


def theta_scores(batch, interp: Interpolation, lam: np.ndarray | float | None = None,
                 chunk: int | None = None, device: torch.device | str = "cpu") -> ThetaScores:
    """Score a batch (monim.lm.token_scores.TokenScores with neighbours) under the interpolated model.

    λ is the constant `interp.lam` or, given, `lam` (a number, or one per token: a calibrator's);
    rows without neighbours (retrieval skipped) use the LM alone. `chunk` rows at a time (`theta_of`),
    on `device` (None: 256 rows on a CPU, 4,096 on a GPU).
    """
    device = torch.device(device)
    chunk = chunk or (4096 if device.type == "cuda" else 256)
    if batch.knn_values is None:  # an empty memory: Θ is the bare LM
        return ThetaScores(batch.logp.astype(np.float64), batch.max_logp.astype(np.float64), batch.argmax)
    lams = row_lam(batch.knn_values, interp.lam if lam is None else lam).to(device)

    def on(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(device)

    out = []
    for i in range(0, len(batch), chunk):
        sl = slice(i, i + chunk)
        prior = _prior(batch, sl)
        out.append(theta_of(on(batch.logp[sl]), on(batch.max_logp[sl]), on(batch.argmax[sl]), on(batch.target[sl]),
                            on(batch.knn_dist[sl]), on(batch.knn_values[sl]), on(batch.lm_logp_values[sl]),
                            None if prior is None else prior.to(device), lams[sl], interp.temperature))
    logp, max_logp, argmax = (torch.cat(p).cpu().numpy() for p in zip(*out))
    return ThetaScores(logp, max_logp, argmax.astype(np.int32))


def target_knn_logprob(batch, temperature: float) -> torch.Tensor:
    """log p_kNN(target) for each token of a scored batch (target-only path)."""
    values = torch.from_numpy(batch.knn_values).long()
    logw = knn_log_weights(torch.from_numpy(batch.knn_dist), values, temperature, _prior(batch, slice(None)))
    return knn_target_logprob(logw, values, torch.from_numpy(batch.target).long())


def _prior(batch, rows: slice) -> torch.Tensor | None:
    return None if batch.knn_prior is None else torch.from_numpy(batch.knn_prior[rows])


def knn_logprobs_by_temperature(batch, temperatures=TEMPERATURES) -> np.ndarray:
    """[n, len(temperatures)]: log p_kNN(target) at each temperature (what λ, T tuning needs): the
    logsumexp of the target's neighbours' scores less all neighbours', the masks built once (a day's
    calibration sample at k = 1,024 took 2.9 s through target_knn_logprob per temperature)."""
    dist, values = torch.from_numpy(batch.knn_dist).double(), torch.from_numpy(batch.knn_values)
    prior = _prior(batch, slice(None))
    missing = values < 0
    other = missing | (values != torch.from_numpy(batch.target)[:, None])
    out = []
    for t in temperatures:
        scores = (-dist / t + (0.0 if prior is None else prior.double())).masked_fill_(missing, -math.inf)
        every = torch.logsumexp(scores, dim=-1)
        out.append(torch.logsumexp(scores.masked_fill_(other, -math.inf), dim=-1) - every)
    return torch.nan_to_num(torch.stack(out, dim=1), nan=-math.inf, neginf=-math.inf).numpy()  # NaN: a row with no neighbour


def perplexity(batches: list, interp: Interpolation | None = None) -> float:
    """PPL of the LM alone (interp None, or no neighbours), or of LM + memory with (λ, T)."""
    nll, n = 0.0, 0
    for b in batches:
        if interp is None or b.knn_values is None:
            logp = torch.from_numpy(b.logp).double()
        else:
            logp = interpolate(torch.from_numpy(b.logp), target_knn_logprob(b, interp.temperature),
                               row_lam(b.knn_values, interp.lam))
        nll -= logp.sum().item()
        n += len(b)
    return math.exp(nll / n) if n else math.nan


def tune_grid(lm_logp: np.ndarray, knn_logp: np.ndarray, lambdas=LAMBDAS,
              temperatures=TEMPERATURES) -> tuple[Interpolation, float]:
    """The (λ, T) with the lowest mean NLL, from log P_LM [n] and log p_kNN at each T [n, len(T)]."""
    if not len(lm_logp):
        return Interpolation(), math.inf
    lm, knn = torch.from_numpy(lm_logp), torch.from_numpy(knn_logp)
    best, best_nll = Interpolation(), math.inf
    for j, temperature in enumerate(temperatures):
        for lam in lambdas:
            nll = -interpolate(lm, knn[:, j], lam).mean().item()
            if nll < best_nll:
                best, best_nll = Interpolation(lam, temperature), nll
    return best, best_nll


def tune_interpolation(batches: list, lambdas=LAMBDAS, temperatures=TEMPERATURES) -> tuple[Interpolation, float]:
    """The (λ, T) of the grid with the lowest mean NLL on these (validation) tokens, and that NLL."""
    batches = [b for b in batches if b.knn_values is not None]
    if not batches:
        return Interpolation(), math.inf
    lm = np.concatenate([b.logp for b in batches])
    knn = np.concatenate([knn_logprobs_by_temperature(b, temperatures) for b in batches])
    return tune_grid(lm, knn, lambdas, temperatures)


RULES = ("lm", "constant", "prior", "calibrator")  # how Θ weighs the memory per token (monim.theta.memory.Memory.lam)


def copies(nearest: Array, key: Array, tolerance: float) -> Array:
    """Whether each token's nearest entry (squared distance) is a near-exact copy of its key (arrays or tensors)."""
    key = key.float() if isinstance(key, torch.Tensor) else key.astype(np.float32)
    return nearest <= tolerance * (key**2).sum(1)


def prior_lam(copied: np.ndarray, lam: float, lam_copy: float) -> np.ndarray:
    """The simple prior: λ_copy where the memory holds the token's very context, else the constant λ."""
    return np.where(copied, lam_copy, lam)


def choose_rule(nll: dict, calibrated: bool = True) -> str:
    """Θ's rule, from what the rules scored on held-out tokens: of those not worse than the LM on new
    text, the one with the lowest NLL over new text and held contexts alike (each counts half); the
    LM alone where none is. Without the calibrator (`calibrated` off), the constant λ or the LM."""
    seen = nll.get("seen") or {}
    candidates = [r for r in (("calibrator", "prior", "constant") if calibrated else ("constant",))
                  if nll.get(r) is not None and not nll[r] > nll["lm"]]
    if not candidates:
        return "lm"
    return min(candidates, key=lambda r: (nll[r] + seen[r]) / 2 if seen.get(r) is not None else nll[r])
