"""The NN calibrator: the kNN weight λ per token, from LM, lexical and neighbour-density features.

Features (method.md): the key; the LM's max probability and entropy ("distribution"); log(count+1)
of the last context token and log(#distinct successors+1) over the memorized text ("lexical");
the top-10 neighbours' distances and the number of distinct values among the top-i ("density").
Each scalar feature and the 20 density numbers go through a small Linear-LeakyReLU-Linear net,
are concatenated with the key, then 4 layers of 128 (ReLU, dropout) give a 2-way log-softmax
(LM weight, kNN weight), the kNN weight capped at LAM_CEIL. The output bias starts at the tuned
constant λ, so training starts near the constant-λ model; early stopping on held-out tokens keeps
the best epoch (0: that start).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from monim.core.config import CalibratorConfig
from monim.theta.knnlm import TEMPERATURES, Array, copies

LAM_FLOOR = 1e-4  # the output bias starts at log λ: a tuned λ of 0 starts it here
# λ's ceiling, also the copy rule's largest (monim.learning.calibration.COPY_LAMBDAS): at λ = 1 the LM gets
# no weight, and a token whose target the neighbours miss costs -inf (a full-volume day saw a
# float32 λ round to exactly 1.0)
LAM_CEIL = 0.99
TOP = 10  # neighbours described by the density features


@dataclass
class Examples:
    """Calibration tokens: raw features, LM log P(target) and log p_kNN(target) per temperature."""

    key: np.ndarray  # float16 [n, d]
    distribution: np.ndarray  # float32 [n, 2]: max_y P(y), entropy
    lexical: np.ndarray  # float32 [n, 2]: log(count+1), log(#distinct successors+1)
    density: np.ndarray  # float32 [n, 2*TOP]: log(1 + distance), distinct values among the top-i
    lm_logp: np.ndarray  # float32 [n]
    knn_logp: np.ndarray  # float32 [n, len(TEMPERATURES)] (empty [n, 0] when built for prediction)
    holdout: np.ndarray  # bool [n]: held back for early stopping
    seen: np.ndarray  # bool [n]: the memory holds the token's own context (its entries were left in the search)
    doc_id: np.ndarray  # str [n]: the article of each token (a forget removes its tokens: monim.storage.commits)

    def __len__(self) -> int:
        return len(self.lm_logp)

    def take(self, rows: np.ndarray) -> Examples:
        return Examples(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    @classmethod
    def concat(cls, parts: list[Examples]) -> Examples:
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def save(self, path: Path) -> None:
        np.savez(path, **{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def load(cls, path: Path) -> Examples:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        arrays.setdefault("seen", np.zeros(len(arrays["lm_logp"]), bool))  # examples saved before monim kept seen ones
        arrays.setdefault("doc_id", np.full(len(arrays["lm_logp"]), ""))  # ... or named each token's article
        return cls(**arrays)


def density_features(dist: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`density_on` of arrays."""
    return density_on(torch.from_numpy(dist), torch.from_numpy(values)).numpy()


def density_on(dist: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[n, 2*TOP]: log(1 + d) of the TOP nearest neighbours, then how many distinct values (-1: none)
    are among the first i+1 of them, computed on their device."""
    n, k = values.shape
    if k < TOP:  # a memory smaller than TOP: pad as missing neighbours
        dist = torch.cat([dist, dist.new_full((n, TOP - k), torch.inf)], dim=1)
        values = torch.cat([values, values.new_full((n, TOP - k), -1)], dim=1)
    dist, values = dist[:, :TOP], values[:, :TOP]
    logd = torch.log1p(torch.where(values >= 0, dist, torch.inf).clamp(max=1e6))
    earlier = torch.ones((TOP, TOP), dtype=torch.bool, device=values.device).tril(-1).T  # [i, j]: i < j
    first = ~((values[:, :, None] == values[:, None, :]) & earlier).any(dim=1) & (values >= 0)
    return torch.cat([logd, first.cumsum(dim=1)], dim=1).float()


def skips(lam: Array, nearest: Array, key: Array, cfg: CalibratorConfig) -> Array:
    """The skip rule (arrays or tensors): the tokens whose λ is below θ (`skip_threshold`) and whose
    nearest entry (squared distance) is no near-exact copy of the key (`copy_tolerance`: a repeated article)."""
    assert cfg.skip_threshold is not None
    return (lam < cfg.skip_threshold) & ~copies(nearest, key, cfg.copy_tolerance)


def examples(batch, lexical, knn_logp: np.ndarray | None = None, holdout: np.ndarray | None = None,
             seen: np.ndarray | None = None) -> Examples:
    """The features of a scored batch (monim.lm.token_scores.TokenScores with neighbours) as Examples.

    `lexical` is a monim.storage.lexical.LexicalCounts; `knn_logp` the targets' log p_kNN per temperature.
    """
    n = len(batch)
    density = (density_features(batch.knn_dist, batch.knn_values) if batch.knn_values is not None
               else np.zeros((n, 2 * TOP), np.float32))
    return Examples(
        key=batch.key,
        distribution=np.stack([np.exp(batch.max_logp), batch.entropy], axis=1).astype(np.float32),
        lexical=lexical.features(batch.prev),
        density=density,
        lm_logp=batch.logp.astype(np.float32),
        knn_logp=np.zeros((n, 0), np.float32) if knn_logp is None else knn_logp.astype(np.float32),
        holdout=np.zeros(n, bool) if holdout is None else holdout,
        seen=np.zeros(n, bool) if seen is None else seen,
        doc_id=np.asarray(batch.doc_id).astype(str),
    )


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(0), x.std(0, unbiased=False).clamp(min=1e-4)


class CalibratorNet(nn.Module):
    """Per-feature embedding nets + key → 4×128 MLP → log (LM weight, kNN weight)."""

    key_mean: torch.Tensor  # the buffers of the input standardization (set in __init__)
    key_std: torch.Tensor
    scalars_mean: torch.Tensor
    scalars_std: torch.Tensor
    density_mean: torch.Tensor
    density_std: torch.Tensor

    def __init__(self, key_dim: int, groups: tuple[str, ...], cfg: CalibratorConfig):
        super().__init__()
        self.groups = groups
        self.n_scalars = 2 * ("distribution" in groups) + 2 * ("lexical" in groups)
        self.key_dim = key_dim if "distribution" in groups else 0
        self.use_density = "density" in groups
        e = cfg.embed
        self.scalar_nets = nn.ModuleList(nn.Sequential(nn.Linear(1, e), nn.LeakyReLU(), nn.Linear(e, e))
                                         for _ in range(self.n_scalars))
        self.density_net = nn.Sequential(nn.Linear(2 * TOP, e), nn.LeakyReLU(), nn.Linear(e, e)) if self.use_density else None
        width = self.key_dim + e * (self.n_scalars + self.use_density)
        layers: list[nn.Module] = []
        for i in range(cfg.layers):
            layers += [nn.Linear(width if i == 0 else cfg.hidden, cfg.hidden), nn.ReLU(), nn.Dropout(cfg.dropout)]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(cfg.hidden, 2)
        # input standardization, fixed when the net is first trained (kept by warm starts)
        for name, dim in (("key", self.key_dim), ("scalars", self.n_scalars), ("density", 2 * TOP * self.use_density)):
            self.register_buffer(f"{name}_mean", torch.zeros(dim))
            self.register_buffer(f"{name}_std", torch.ones(dim))

    def inputs(self, ex: Examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The feature groups this net reads, as float32 tensors (key, scalars, density)."""
        return self.inputs_of(*(torch.from_numpy(a) for a in (ex.key, ex.distribution, ex.lexical, ex.density)))

    def inputs_of(self, key: torch.Tensor, distribution: torch.Tensor, lexical: torch.Tensor,
                  density: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`inputs` from Examples' fields as tensors, on their device."""
        none = torch.zeros(len(key), 0, device=key.device)
        read = [distribution] * ("distribution" in self.groups) + [lexical] * ("lexical" in self.groups)
        return (key.float() if self.key_dim else none, torch.cat(read, dim=1) if read else none,
                density if self.use_density else none)

    def fit_standardization(self, ex: Examples, lam: float) -> None:
        """Set the input standardization from training data, and the output bias to the constant λ."""
        for name, x in zip(("key", "scalars", "density"), self.inputs(ex)):
            if x.shape[1]:
                mean, std = _stats(x)
                getattr(self, f"{name}_mean").copy_(mean)
                getattr(self, f"{name}_std").copy_(std)
        with torch.no_grad():  # (zero output weights would leave ReLU units dead for one side)
            lam = max(lam, LAM_FLOOR)
            self.out.bias.copy_(torch.tensor([math.log1p(-lam), math.log(lam)]))

    def forward(self, key: torch.Tensor, scalars: torch.Tensor, density: torch.Tensor) -> torch.Tensor:
        key = (key - self.key_mean) / self.key_std
        scalars = (scalars - self.scalars_mean) / self.scalars_std
        parts = [key] + [net(scalars[:, i : i + 1]) for i, net in enumerate(self.scalar_nets)]
        if self.density_net is not None:
            parts.append(self.density_net((density - self.density_mean) / self.density_std))
        z = self.out(self.mlp(torch.cat(parts, dim=1)))
        logit = (z[:, 1] - z[:, 0]).clamp(max=math.log(LAM_CEIL / (1 - LAM_CEIL)))
        return torch.stack([nn.functional.logsigmoid(-logit), nn.functional.logsigmoid(logit)], dim=1)


@dataclass
class Calibrator:
    """A trained calibrator: its net, the kNN temperature it was trained with, and its summary."""

    net: CalibratorNet
    temperature: float  # one of monim.theta.knnlm.TEMPERATURES
    config: CalibratorConfig
    summary: dict = field(default_factory=dict)  # day trained on, epochs, held-out NLL, seconds

    @torch.no_grad()
    def lam(self, ex: Examples, chunk: int = 4096) -> np.ndarray:
        """The predicted kNN weight λ of each token."""
        self.net.eval()
        out = [self.net(*(x[i : i + chunk] for x in self.net.inputs(ex)))[:, 1].exp() for i in range(0, len(ex), chunk)]
        return torch.cat(out).double().numpy() if out else np.zeros(0)

    def save(self, path: Path) -> None:
        torch.save({"state": self.net.state_dict(), "temperature": self.temperature, "config": asdict(self.config),
                    "record": self.summary}, path)

    @classmethod
    def load(cls, path: Path, key_dim: int) -> Calibrator:
        saved = torch.load(path, weights_only=True)
        known = {f.name for f in fields(CalibratorConfig)}  # settings a newer monim renamed or dropped are ignored
        cfg = CalibratorConfig(**{k: v for k, v in saved["config"].items() if k in known})
        net = CalibratorNet(key_dim, cfg.groups, cfg)
        net.load_state_dict(saved["state"])
        return cls(net, saved["temperature"], cfg, saved["record"])


def mixture_nll(logw: torch.Tensor, lm_logp: torch.Tensor, knn_logp: torch.Tensor) -> torch.Tensor:
    """Per token -log((1-λ) P_LM + λ p_kNN) with log (1-λ, λ) = logw."""
    return -torch.logaddexp(logw[:, 0] + lm_logp, logw[:, 1] + knn_logp.clamp(min=-1e4))


def train_calibrator(ex: Examples, cfg: CalibratorConfig, lam: float, temperature: float,
                     start: Calibrator | None = None, epochs: int | None = None) -> Calibrator:
    """Train on the non-held-out examples, keeping the epoch (0: the start) with the best held-out NLL.

    The start is yesterday's calibrator (warm start, if its feature groups match) or a fresh net
    whose output is the constant λ.
    """
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    train, held = ex.take(~ex.holdout), ex.take(ex.holdout)
    if not len(train) or not len(held):  # too few articles to hold some back: no early stopping
        train = held = ex
    warm = start if start is not None and start.net.groups == cfg.groups and start.temperature == temperature else None
    column = TEMPERATURES.index(temperature)  # of Examples.knn_logp
    if warm is not None:
        net = copy.deepcopy(warm.net)
    else:
        net = CalibratorNet(ex.key.shape[1], cfg.groups, cfg)
        net.fit_standardization(train, lam)
    epochs = epochs if epochs is not None else cfg.max_epochs
    inputs, targets = net.inputs(train), (torch.from_numpy(train.lm_logp), torch.from_numpy(train.knn_logp[:, column]))
    held_inputs = net.inputs(held)
    held_targets = (torch.from_numpy(held.lm_logp), torch.from_numpy(held.knn_logp[:, column]))

    def held_nll() -> float:
        net.eval()
        with torch.no_grad():
            return mixture_nll(net(*held_inputs), *held_targets).mean().item()

    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    best_nll, best_state, best_epoch = held_nll(), copy.deepcopy(net.state_dict()), 0
    start_nll = best_nll
    for epoch in range(1, epochs + 1):
        net.train()
        for rows in torch.randperm(len(train)).split(cfg.batch_size):
            logw = net(*(x[rows] for x in inputs))
            loss = mixture_nll(logw, *(t[rows] for t in targets)).mean() + cfg.knn_penalty * logw[:, 1].exp().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        nll = held_nll()
        if nll < best_nll:
            best_nll, best_state, best_epoch = nll, copy.deepcopy(net.state_dict()), epoch
    net.load_state_dict(best_state)
    summary = {"warm_start": warm is not None, "epochs": epochs, "best_epoch": best_epoch, "train_tokens": len(train),
              "held_out_tokens": len(held), "held_out_nll_start": start_nll, "held_out_nll": best_nll,
              "seconds": time.perf_counter() - started}
    return Calibrator(net, temperature, cfg, summary)


def warm_epochs(cfg: CalibratorConfig, days_trained: int) -> int:
    """Epochs for today's warm start: one fewer for each day already trained, down to 1."""
    return max(1, cfg.max_epochs - days_trained)
