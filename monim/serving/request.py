"""A request to the served Θ, read and checked before any work: MLflow's scoring format in any of its
four forms, as MLflow's scoring server reads them into a DataFrame (`parse`), every refusal naming the
field as the body wrote it and the limit; the body's JSON read with a nesting limit (`loads`).

Rows {"text": ...} (scored) or {"prompt": ...} (continued) under "dataframe_records",
"dataframe_split", "inputs" or "instances"; "params": {"max_new_tokens", "temperature", "top_p",
"seed", "sources"}.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field, fields

from monim.core.text import json_depth, lone_surrogate
from monim.serving.generation import GenerateConfig

ROW_FIELDS = ("text", "prompt")


@dataclass(frozen=True)
class Limits:
    """What one request may ask (the server's defaults, documented in the README)."""

    max_rows: int = 32  # rows per request
    max_chars: int = 20_000  # characters per text or prompt
    max_new_tokens: int = 256  # tokens a prompt may ask for
    seconds: float = 60.0  # per request, waiting included: a continuation stops there and answers with what it wrote
    max_body_bytes: int | None = None  # bytes a body may hold; None: room for max_rows rows of max_chars characters
    max_depth: int = 32  # how deep a body's JSON may nest (a request needs 4)

    def __post_init__(self) -> None:
        if self.max_body_bytes is None:  # 12 bytes a character: an escaped surrogate pair; 64 KiB for the rest
            object.__setattr__(self, "max_body_bytes", 12 * self.max_chars * self.max_rows + 65_536)


class BadRequest(ValueError):
    """A request monim will not answer: the message names the field (and the limit)."""


@dataclass
class Request:
    """A checked request: its rows as (field, value), each row's field as the body named it, and how
    prompts are continued."""

    rows: list[tuple[str, str]]
    generation: GenerateConfig
    retrieve: frozenset[int] = frozenset()  # the prompt rows asking for the best article before them ("retrieve": true)
    named: list[str] = field(default_factory=list)  # each row's text or prompt as the body names it, for refusals


FORMATS = ("dataframe_split", "dataframe_records", "inputs", "instances")  # MLflow's scoring formats
SHORT = reprlib.Repr()  # a value as a refusal quotes it: cut short
SHORT.maxstring = SHORT.maxother = 80


def loads(raw: bytes, limits: Limits) -> object:
    """A body's JSON (UTF-8, as RFC 8259 has it), or a BadRequest where it is not or nests deeper than
    the limit (counted on its brackets outside strings before parsing: Python's json recurses once a level)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not JSON in UTF-8: {e}") from None
    if (depth := json_depth(text)) > limits.max_depth:
        raise BadRequest(f"the body nests {depth} levels deep; at most {limits.max_depth}")
    try:
        return json.loads(text)
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None


def _param(name: str, value, kind: type):
    """A param of the right type, or a BadRequest naming it (a bool is no number; sources takes either)."""
    if name == "sources" and isinstance(value, bool):
        return 3 if value else 0
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (kind is float or isinstance(value, int) or value.is_integer())):
        raise BadRequest(f"params.{name}: expected {'a whole number' if kind is int else 'a number'}"
                         f"{' or true/false' if name == 'sources' else ''}, got {SHORT.repr(value)}")
    try:
        return kind(value)
    except OverflowError:
        raise BadRequest(f"params.{name}: {SHORT.repr(value)} is too large") from None


def parse(body: object, limits: Limits) -> Request:
    """A request body in any of MLflow's four formats checked against the limits; unknown fields and
    params are refused by name, and every refusal names the field as the body does."""
    if not isinstance(body, dict):
        raise BadRequest("send a JSON object: {\"dataframe_records\": [{\"text\": ...} or {\"prompt\": ...}], "
                         "\"params\": {...}} (or MLflow's dataframe_split, inputs, instances)")
    unknown = sorted(set(body) - {*FORMATS, "params"}, key=str)
    if unknown:
        raise BadRequest(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(SHORT.repr, unknown))}: send one of "
                         f"{', '.join(map(repr, FORMATS))} (and optionally 'params')")
    given = [f for f in FORMATS if f in body]
    if len(given) != 1:
        raise BadRequest(f"send exactly one of {', '.join(map(repr, FORMATS))}, got {given or 'none'}")
    rows = [_row(item, at, limits) for item, at in request_rows(given[0], body[given[0]], limits)]
    params = body.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadRequest(f"params: expected an object, got {type(params).__name__}")
    kinds = {f.name: f.type for f in fields(GenerateConfig) if f.name not in ("keep_distributions", "retrieve")}
    unknown = sorted(set(params) - set(kinds), key=str)
    if unknown:
        raise BadRequest(f"params: unknown {', '.join(map(SHORT.repr, unknown))}; known: {', '.join(kinds)}")
    values = {k: _param(k, v, float if kinds[k] in ("float", float) else int) for k, v in params.items()}
    values.setdefault("max_new_tokens", min(GenerateConfig.max_new_tokens, limits.max_new_tokens))  # a server's lower limit
    if values["max_new_tokens"] > limits.max_new_tokens:
        raise BadRequest(f"params.max_new_tokens: {values['max_new_tokens']}; at most {limits.max_new_tokens}")
    try:
        generation = GenerateConfig(**values)
    except ValueError as e:
        raise BadRequest(f"params: {e}"[:300]) from None
    return Request([(name, value) for name, value, _, _ in rows], generation,
                   frozenset(i for i, (_, _, retrieve, _) in enumerate(rows) if retrieve), [n for *_, n in rows])


def request_rows(form: str, data: object, limits: Limits) -> list[tuple[object, tuple[str, str]]]:
    """The rows of a body's `form` field as MLflow's scoring server reads them into a DataFrame, each
    with where it is in the body ((before, after) a column's name): `dataframe_records` and a list
    under `inputs` or `instances` hold one object a row, a dict under them one list a column (or
    one value a column: one row), `dataframe_split` pandas' `to_dict(orient="split")`."""
    if form == "dataframe_split":
        return _split(data, limits)
    if isinstance(data, dict) and form != "dataframe_records":
        return _columns(form, data, limits)
    if not isinstance(data, list) or not data:
        raise BadRequest(f"{form}: send a list of one or more rows, each {{\"text\": ...}} (to score) or "
                         f"{{\"prompt\": ...}} (to continue){'' if form == 'dataframe_records' else ', or an object of columns'}")
    _count(form, len(data), limits)
    return [(r, (f"{form}[{i}]", "")) for i, r in enumerate(data)]


def _count(where: str, n: int, limits: Limits) -> None:
    if n > limits.max_rows:
        raise BadRequest(f"{where}: {n} rows; at most {limits.max_rows} a request")


def _columns(form: str, data: dict, limits: Limits) -> list[tuple[object, tuple[str, str]]]:
    """A dict of columns, each a list of one value a row (or each a single value: one row)."""
    lists = {isinstance(v, list) for v in data.values()}
    if lists == {False}:
        return [(data, (form, ""))]
    lengths = {len(v) for v in data.values() if isinstance(v, list)}
    if lists != {True} or len(lengths) != 1 or 0 in lengths:
        raise BadRequest(f"{form}: give every column as a list of one value a row, all of the same length (or every "
                         f"column as one value), got {', '.join(f'{k!r}: {_shape(v)}' for k, v in data.items())}"[:300])
    (n,) = lengths
    _count(form, n, limits)
    return [({k: v[i] for k, v in data.items()}, (form, f"[{i}]")) for i in range(n)]


def _shape(value: object) -> str:
    return f"{len(value)} value{'s' * (len(value) != 1)}" if isinstance(value, list) else "one value"


def _split(data: object, limits: Limits) -> list[tuple[object, tuple[str, str]]]:
    """pandas' split orient: {"columns": [names], "data": [[a value a column], ...], "index": [labels]?}."""
    shape = 'send {"columns": ["text"], "data": [["..."], ...]} (pandas\' to_dict(orient="split"))'
    if not isinstance(data, dict):
        raise BadRequest(f"dataframe_split: {shape}, got {type(data).__name__}")
    unknown = sorted(set(data) - {"columns", "data", "index"}, key=str)
    if unknown:
        raise BadRequest(f"dataframe_split: unknown field {', '.join(map(SHORT.repr, unknown))}; {shape}")
    columns, rows, index = data.get("columns"), data.get("data"), data.get("index")
    if not isinstance(columns, list) or not columns or not all(isinstance(c, str) for c in columns):
        raise BadRequest(f"dataframe_split.columns: send the column names, e.g. [\"text\"], got {SHORT.repr(columns)}")
    if len(set(columns)) != len(columns):
        raise BadRequest(f"dataframe_split.columns: a column named twice in {SHORT.repr(columns)}")
    if not isinstance(rows, list) or not rows:
        raise BadRequest("dataframe_split.data: send a list of one or more rows, each a list of one value a column")
    _count("dataframe_split.data", len(rows), limits)
    if index is not None and not (isinstance(index, list) and len(index) == len(rows)):
        raise BadRequest(f"dataframe_split.index: one label a row ({len(rows)}), got {SHORT.repr(index)}")
    out: list[tuple[object, tuple[str, str]]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            row = [row] if len(columns) == 1 else row  # one column: pandas takes a value a row
        if not isinstance(row, list) or len(row) != len(columns):
            raise BadRequest(f"dataframe_split.data[{i}]: expected a list of {len(columns)} value"
                             f"{'s' * (len(columns) > 1)}, one a column, got {SHORT.repr(row)}")
        out.append((dict(zip(columns, row)), (f"dataframe_split.data[{i}]", "")))
    return out


def _missing(value: object) -> bool:
    """A DataFrame's empty cell: null, or NaN (pandas' missing value)."""
    return value is None or isinstance(value, float) and value != value


def _row(row: object, at: tuple[str, str], limits: Limits) -> tuple[str, str, bool, str]:
    """A row checked: (its field, its text, whether it asks to retrieve, the field as the body names it)."""
    before, after = at
    if not isinstance(row, dict):
        raise BadRequest(f"{before}{after}: expected an object with 'text' or 'prompt', got {type(row).__name__}")
    unknown = sorted(set(row) - {*ROW_FIELDS, "retrieve"}, key=str)
    given = {k: v for k, v in row.items() if k in ROW_FIELDS and not _missing(v)}
    if unknown or len(given) != 1:
        what = f"unknown field {', '.join(map(SHORT.repr, unknown))}" if unknown else f"got {sorted(given) or 'nothing'}"
        raise BadRequest(f"{before}{after}: give exactly one of 'text' (to score) or 'prompt' (to continue); {what}")
    (name, value), = given.items()
    named = f"{before}.{name}{after}"
    retrieve = False if _missing(row.get("retrieve")) else row["retrieve"]
    if not isinstance(retrieve, bool) or retrieve and name != "prompt":
        raise BadRequest(f"{before}.retrieve{after}: true or false, on a 'prompt' row (a text is scored as the model "
                         f"reads it), got {SHORT.repr(retrieve)}")
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{named}: expected non-empty text, got {SHORT.repr(value)}")
    if len(value) > limits.max_chars:
        raise BadRequest(f"{named}: {len(value)} characters; at most {limits.max_chars}")
    if (where := lone_surrogate(value)) is not None:  # JSON's "\ud800": no character, no token
        raise BadRequest(f"{named}: a lone surrogate {value[where]!r} at character {where}: not Unicode text")
    return name, value, retrieve, named
