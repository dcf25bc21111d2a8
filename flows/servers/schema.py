"""The served model's HTTP API as OpenAPI documents it: MLflow's scoring format (its four forms), the
answers, the errors and the limits. `monim.serving.service.parse` checks a request (naming the field and the limit it breaks);
these models describe the same fields for FastAPI's schema (tests/test_docs.py holds them equal)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from monim.serving.generate import GenerateConfig
from monim.serving.request import Limits as ServiceLimits

DEFAULTS, LIMITS = GenerateConfig(), ServiceLimits()


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


class Columns(BaseModel):
    """Rows as columns: one list a field, a value a row (null where a row has none), or one value a field (one row)."""

    model_config = ConfigDict(extra="forbid")
    text: list[str | None] | str | None = None
    prompt: list[str | None] | str | None = None
    retrieve: list[bool | None] | bool | None = None


class Split(BaseModel):
    """pandas' `to_dict(orient="split")`: the column names, a list of values a row (one a column), the row labels."""

    model_config = ConfigDict(extra="forbid")
    columns: list[str] = Field(min_length=1, description="Column names: text, prompt, retrieve.")
    data: list[list[str | bool | None] | str] = Field(min_length=1, description="The rows, each one value a column (null or NaN where none).")
    index: list | None = Field(None, description="Row labels (ignored).")


class Invocation(BaseModel):
    """A request: MLflow's scoring format, the rows in exactly one of its four forms (as MLflow's scoring
    server reads them), and the params. A refusal names the field as the body wrote it, e.g.
    `dataframe_split.data[2].text` or `inputs.text[2]`."""

    model_config = ConfigDict(extra="forbid")
    dataframe_records: list[Row] | None = Field(None, min_length=1, description="One object a row (at most the server's --max-rows).")
    dataframe_split: Split | None = Field(None, description="pandas' split orient (what MLflow's scoring client sends for a DataFrame).")
    inputs: list[Row] | Columns | None = Field(None, description="One object a row, or the rows as columns.")
    instances: list[Row] | Columns | None = Field(None, description="As `inputs`.")
    params: Params | None = None


class Predictions(BaseModel):
    """The answers, one per row in order: for a text {tokens, ppl, ppl_lm}; for a prompt {text, tokens,
    lam, sentences (each with its sources), stopped}."""

    predictions: list[dict]


class Error(BaseModel):
    """Every error, whatever its status: one JSON object naming what is wrong (the trace stays in the server's log)."""

    error_code: str = Field(description="BAD_REQUEST (400: not JSON, nested deeper than max_depth, or a field refused: "
                            "the message names it and the limit), REQUEST_ENTITY_TOO_LARGE (413: a body over "
                            "max_body_bytes, refused before it is read whole), BUSY (503: the server is stopping, or "
                            "Θ was busy for the request's whole budget), INTERNAL_ERROR (500); NOT_FOUND (404) and "
                            "METHOD_NOT_ALLOWED (405) for a route or method not served.")
    message: str


class Limits(BaseModel):
    """What one request may ask: the defaults (`monim serve-model`'s options set the first four; /health shows a server's)."""

    max_rows: int = Field(LIMITS.max_rows, description="Rows a request (--max-rows).")
    max_chars: int = Field(LIMITS.max_chars, description="Characters a text or prompt (--max-chars).")
    max_new_tokens: int = Field(LIMITS.max_new_tokens, description="Tokens a prompt may ask for (--max-new-tokens).")
    seconds: float = Field(LIMITS.seconds, description="Seconds a request, waiting included (--seconds): a continuation "
                           "stops there and answers with what it wrote.")
    max_body_bytes: int = Field(LIMITS.max_body_bytes, description="Bytes a body: room for max_rows rows of max_chars "
                                "characters, 12 bytes each (an escaped surrogate pair), and 64 KiB.")
    max_depth: int = Field(LIMITS.max_depth, description="How deep the body's JSON may nest.")


class Health(BaseModel):
    """What is served and since when: status ok, stale (the champion cannot load: the last good version
    answers), failing, or damaged (the served files differ from their commit: every request is refused,
    503); the model, version, its day `as_of`, checksum, `served_since`; the champion as last seen
    (`checked_at`, any error) and the limits."""

    model_config = ConfigDict(extra="allow")
    status: str
    limits: Limits
