"""The served model's HTTP API as OpenAPI documents it: MLflow's scoring format, the answers and the
errors. `monim.serving.service.parse` checks a request (naming the field and the limit it breaks);
these models describe the same fields for FastAPI's schema (tests/test_docs.py holds them equal)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from monim.serving.generate import GenerateConfig

DEFAULTS = GenerateConfig()


class Row(BaseModel):
    """One row: a `text` to score, or a `prompt` to continue (exactly one)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = Field(None, description="Text to score: Θ's perplexity and the LM's alone.")
    prompt: str | None = Field(None, description="A prompt to continue with Θ (λ per token, sources per sentence).")
    retrieve: bool = Field(False, description="A prompt row only: the best BM25 article the memory learned before it.")


class Params(BaseModel):
    """How prompts are continued (all optional)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(DEFAULTS.max_new_tokens, ge=1, description="Tokens to write (at most the server's --max-new-tokens).")
    temperature: float = Field(DEFAULTS.temperature, ge=0, description="0: greedy; above: sampled.")
    top_p: float = Field(DEFAULTS.top_p, gt=0, le=1, description="Nucleus sampling's mass.")
    seed: int = Field(DEFAULTS.seed, ge=0, description="The sampler's seed.")
    sources: int | bool = Field(DEFAULTS.sources, description="Memorized articles cited per sentence (true: 3, false: 0).")


class Invocation(BaseModel):
    """A request: MLflow's `dataframe_records` format."""

    model_config = ConfigDict(extra="forbid")
    dataframe_records: list[Row] = Field(min_length=1, description="Rows (at most the server's --max-rows).")
    params: Params | None = None


class Predictions(BaseModel):
    """The answers, one per row in order: for a text {tokens, ppl, ppl_lm}; for a prompt {text, tokens,
    lam, sentences (each with its sources), stopped}."""

    predictions: list[dict]


class Error(BaseModel):
    """Every error: one JSON object naming what is wrong (the trace stays in the server's log)."""

    error_code: str = Field(description="BAD_REQUEST (400), BUSY (503) or INTERNAL_ERROR (500).")
    message: str


class Health(BaseModel):
    """What is served and since when: status ok, stale (the champion cannot load: the last good version
    answers), failing, or damaged (the served files differ from their commit: every request is refused,
    503); the model, version, its day `as_of`, checksum, `served_since`; the champion as last seen
    (`checked_at`, any error) and the limits."""

    model_config = ConfigDict(extra="allow")
    status: str
