"""The served model's HTTP API as OpenAPI documents it: MLflow's scoring format (its four forms), the
answers, the errors and the limits. `monim.serving.service.parse` checks a request (naming the field and the limit it breaks);
these models describe the same fields for FastAPI's schema (tests/test_docs.py holds them equal). The answers'
models are the routes' response_model: each answer is exactly one (tests/test_http_reference.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from monim.serving.generation import GenerateConfig
from monim.serving.request import Limits as ServiceLimits

DEFAULTS, LIMITS = GenerateConfig(), ServiceLimits()
BODY_BYTES = LIMITS.max_body_bytes or 0  # never 0: ServiceLimits sets it from the other limits


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


class Score(BaseModel):
    """A `text` row's answer: its perplexity under Θ and under the LM alone, over the tokens predicted."""

    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(description="Tokens scored (the perplexities are over these).")
    ppl: float = Field(description="Θ's perplexity: the LM with the memory, under the calibrator's λ per token.")
    ppl_lm: float = Field(description="The LM's perplexity alone (no memory).")


class Article(BaseModel):
    """A memorized article: its day, id and headline."""

    model_config = ConfigDict(extra="forbid")
    date: str = Field(description="The day it was learned (YYYY-MM-DD).")
    doc_id: str = Field(description="Its id in the feed (what `monim forget` takes).")
    title: str = Field(description="Its headline, cut short (empty where the feed has none).")


class Cited(Article):
    """A memorized article cited by a sentence, and the kNN weight its entries gave the sentence's tokens."""

    weight: float = Field(description="The kNN weight (λ times the neighbour's share) summed over the sentence's tokens.")


class Sentence(BaseModel):
    """A sentence of the continuation and the articles that carried the most kNN weight toward it."""

    model_config = ConfigDict(extra="forbid")
    text: str
    sources: list[Cited] = Field(description="At most `params.sources`, the heaviest first; empty where the LM wrote it alone.")


class Continuation(BaseModel):
    """A `prompt` row's answer: the continuation, λ per token, each sentence with its sources."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(description="The prompt, as sent.")
    text: str = Field(description="What Θ wrote after it.")
    tokens: list[int] = Field(description="The token ids written.")
    lams: list[float] = Field(description="λ of each token: the memory's share of Θ's distribution (0: the LM alone).")
    sentences: list[Sentence]
    stopped: str = Field(description="Why it ended: max_new_tokens, eos, or a time limit (`time limit (60 s)`: what it "
                         "wrote by then), the caller gone, the server stopping.")
    sources: list[Article] = Field(description="With `retrieve: true`: the best BM25 article the memory learned, put "
                                   "before the prompt (none where there is no article to retrieve); else empty.")


class Predictions(BaseModel):
    """The answers, one a row in the request's order: a `Score` for a text, a `Continuation` for a prompt."""

    model_config = ConfigDict(extra="forbid")
    predictions: list[Score | Continuation]


ERRORS = {  # every error_code the server answers: (its HTTP status, when)
    "BAD_REQUEST": (400, "The body is not JSON in UTF-8, nests deeper than `max_depth`, or a field or param is "
                    "refused (unknown, of the wrong type, over a limit, a lone surrogate): the message names it as "
                    "the body wrote it, and the limit. The body is checked by the server itself: there is no 422."),
    "REQUEST_ENTITY_TOO_LARGE": (413, "The body is over `max_body_bytes`, as declared (`Content-Length`) or once "
                                 "read that far (chunked): the rest is never read."),
    "BUSY": (503, "Nothing was answered: the server is stopping, Θ was busy for the request's whole `seconds`, or "
             "a served file differs from its commit (damaged: `/ping` answers 503 too). Try again, or see `/health`."),
    "INTERNAL_ERROR": (500, "Θ failed: the message says how, the trace is in the server's log (`/health` says "
                       "failing until an answer succeeds)."),
    "NOT_FOUND": (404, "A route not served."),
    "METHOD_NOT_ALLOWED": (405, "A route asked with another method (`GET /invocations`)."),
}


class Error(BaseModel):
    """Every error, whatever its status: one JSON object naming what is wrong (the trace stays in the server's log)."""

    model_config = ConfigDict(extra="forbid")
    error_code: Literal[tuple(ERRORS)] = Field(  # type: ignore[valid-type]  # pydantic reads the codes at runtime
        description=", ".join(f"{c} ({s})" for c, (s, _) in ERRORS.items()))
    message: str


class Limits(BaseModel):
    """What one request may ask: the defaults (`monim serve-model`'s options set the first four; /health shows a server's)."""

    max_rows: int = Field(LIMITS.max_rows, description="Rows a request (--max-rows).")
    max_chars: int = Field(LIMITS.max_chars, description="Characters a text or prompt (--max-chars).")
    max_new_tokens: int = Field(LIMITS.max_new_tokens, description="Tokens a prompt may ask for (--max-new-tokens).")
    seconds: float = Field(LIMITS.seconds, description="Seconds a request, waiting included (--seconds): a continuation "
                           "stops there and answers with what it wrote.")
    max_body_bytes: int = Field(BODY_BYTES, description="Bytes a body: room for max_rows rows of max_chars "
                                "characters, 12 bytes each (an escaped surrogate pair), and 64 KiB.")
    max_depth: int = Field(LIMITS.max_depth, description="How deep the body's JSON may nest.")


class Ping(BaseModel):
    """Ready: ok (200) once the model is loaded; damaged (503) while its files differ from their commit, and why."""

    model_config = ConfigDict(extra="forbid")
    status: Literal["ok", "damaged"]
    problem: str | None = Field(description="Which file differs, and from which day's commit (null when ok).")


class Version(BaseModel):
    """A registered version of Θ: the model, its version and its day."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="The registered model, `monim-<stream>-<policy>`.")
    version: str = Field(description="Its version in MLflow's Model Registry.")
    as_of: str | None = Field(description="The day Θ is as of (its memory's last day then).")


class Registered(Version):
    """A registered version of Θ and the files it reads."""

    memory: str = Field(description="The memory's folder.")
    checksum: str | None = Field(description="The checksum of what Θ reads, as registered.")


class Served(Version):
    """What `GET /version` says: monim's version, the LM, and the version of Θ served."""

    monim: str = Field(description="monim's version (`monim --version`).")
    lm: str = Field(description="The language model Θ is built on.")


class Health(Registered):
    """What is served and since when: status ok, stale (the champion cannot load: the last good version
    answers), failing (Θ's last answer failed), or damaged (the served files differ from their commit: every
    request is refused, 503); the version served; the champion as last seen, and the limits. A server
    started with `--version N` follows nothing: `follows` and the fields after it are null."""

    status: Literal["ok", "stale", "failing", "damaged"]
    problem: str | None = Field(description="Why the status is not ok (null when it is).")
    served_since: str = Field(description="When the served version began answering (UTC, ISO 8601).")
    follows: Literal["champion"] | None = Field(description="The alias followed, or null (`--version N`).")
    checked_every_s: float | None = Field(description="How often the alias is looked at (`--follow-seconds`).")
    checked_at: str | None = Field(description="When it was last looked at (UTC; null before the first look).")
    champion: Registered | None = Field(description="The version the alias pointed to at that look.")
    error: str | None = Field(description="Why the champion is not the one served (it could not be found or loaded).")
    limits: Limits
