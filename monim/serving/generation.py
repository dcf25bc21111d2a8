"""What generation is asked to do (GenerateConfig) and what it gives back (Generation)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class GenerateConfig:
    """How to generate: greedy at temperature 0, else sampled (nucleus `top_p`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sources: int = 3  # memorized articles listed per generated sentence
    keep_distributions: bool = False  # keep Θ's log-probabilities at each step (Generation.logprobs)
    retrieve: bool = False  # the best article for the prompt before it (In-Context RALM; a ralm memory's Θ always does)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sources < 0:
            raise ValueError(f"sources must be >= 0, got {self.sources}")



@dataclass
class Generation:
    """A prompt's continuation, the kNN weight λ of each step, and each sentence with its sources."""

    prompt: str
    text: str
    tokens: list[int]
    lams: list[float]
    sentences: list[dict] = field(default_factory=list)  # {"text", "sources": [Cited as dict]}
    stopped: str = "max_new_tokens"  # why it ended: max_new_tokens, eos, or what `should_stop` said (a time limit, ...)
    logprobs: list[np.ndarray] | None = None  # Θ's log P over the vocabulary before each step
    sources: list[dict] = field(default_factory=list)  # the article put before the prompt (retrieve): date, doc_id, title

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "logprobs"}

