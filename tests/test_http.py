"""The served model's HTTP face: a request in any of MLflow's four formats read as MLflow reads it and
checked field by field (any JSON, any Unicode: a Request or a refusal naming the field), a body read
no further than its limits, and `monim serve-model` answering clients at once, MLflow's scoring
client and the pyfunc model alike, every error one JSON object, abandoned requests and SIGTERM."""

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from helpers import at_once, demo_texts
from monim.core.config import DEMO_STREAM

REPO = Path(__file__).resolve().parents[1]


def test_every_format_of_mlflows_reads_as_the_same_rows_and_refusals_name_the_formats_field():
    """The four request formats MLflow's scoring server takes, as it reads them into a DataFrame (its own
    reading is the reference), give the same rows; a refusal names the field
    as the body wrote it (a lone surrogate included: the tokenizer would fail on it)."""
    import pandas as pd
    from mlflow.pyfunc.scoring_server import infer_and_parse_data

    from monim.serving.request import BadRequest, Limits, parse

    rows = [{"text": "Oil prices rose."}, {"prompt": "The bank said", "retrieve": True}, {"prompt": "Shares fell"}]
    frame = pd.DataFrame(rows)
    columns = {k: [r.get(k) for r in rows] for k in ("text", "prompt", "retrieve")}
    bodies = [{"dataframe_records": rows}, {"dataframe_split": frame.to_dict(orient="split")},
              {"dataframe_split": json.loads(frame.to_json(orient="split"))}, {"inputs": rows}, {"inputs": columns},
              {"instances": rows}, {"instances": columns}]
    want = [("text", "Oil prices rose."), ("prompt", "The bank said"), ("prompt", "Shares fell")]
    for body in bodies:
        request = parse(json.loads(json.dumps(body)), Limits())
        assert request.rows == want and request.retrieve == {1}, body
        if body.get("instances") is not rows:  # (MLflow reads records of different fields under instances as columns)
            read = pd.DataFrame(infer_and_parse_data(json.loads(json.dumps(body))))  # MLflow's reading
            assert [(k, v) for r in read.to_dict("records") for k, v in r.items() if k != "retrieve" and v == v
                    and v is not None] == want, body
    assert parse({"inputs": {"prompt": "Hi"}}, Limits()).rows == [("prompt", "Hi")]  # a dict of values: one row
    assert parse({"dataframe_split": {"columns": ["text"], "data": ["a b", "c d"]}}, Limits()).rows == [
        ("text", "a b"), ("text", "c d")]  # one column: pandas takes a value a row
    for body, says in (({"dataframe_split": {"columns": ["text"], "data": [["a"], ["b", "c"]]}}, "dataframe_split.data[1]: "),
                       ({"dataframe_split": {"data": [["a"]]}}, "dataframe_split.columns: "),
                       ({"dataframe_split": {"columns": ["text"], "data": [["a"]], "index": [0, 1]}}, "dataframe_split.index: "),
                       ({"dataframe_split": {"columns": ["text"], "data": [["a"]], "orient": "split"}}, "unknown field 'orient'"),
                       ({"dataframe_split": {"columns": ["txt"], "data": [["a"]]}}, "dataframe_split.data[0]: give exactly one"),
                       ({"dataframe_split": {"columns": ["text"], "data": [["a"]] * 33}}, "dataframe_split.data: 33 rows; at most 32"),
                       ({"inputs": {"text": ["a", "b"], "prompt": ["c"]}}, "inputs: give every column as a list"),
                       ({"instances": {"text": ["a", "x" * 20_001]}}, "instances.text[1]: 20001 characters"),
                       ({"inputs": [{"prompt": "ok"}, {"text": "a\ud800b"}]}, "inputs[1].text: a lone surrogate '\\ud800' at character 1"),
                       ({"dataframe_split": {"columns": ["prompt"], "data": [["\udfff"]]}}, "dataframe_split.data[0].prompt: a lone"),
                       ({"instances": {"prompt": ["x"], "retrieve": ["yes"]}}, "instances.retrieve[0]: true or false"),
                       ({"dataframe_records": [{"text": "a", "txt": None}]}, "unknown field 'txt'"),
                       ({"inputs": ["a", "b"]}, "inputs[0]: expected an object"),
                       ({"dataframe_records": [{"text": "a"}], "inputs": {"text": "a"}}, "send exactly one of")):
        with pytest.raises(BadRequest, match=re.escape(says)):
            parse(body, Limits())


ROW_NAMES = st.sampled_from(["text", "prompt", "retrieve"])
TEXT = st.text(st.characters(exclude_categories=()) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
               | st.sampled_from("\x00 ab"), max_size=8)  # any code point, lone surrogates and NULs often
VALUE = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ROW_NAMES | TEXT, inner, max_size=3),
                     max_leaves=8)
CELL = st.one_of(TEXT, st.none() | VALUE)  # a row's text or prompt: text half the time
ROW = st.one_of(st.dictionaries(st.sampled_from(["text", "prompt"]), CELL, min_size=1, max_size=2),
                st.fixed_dictionaries({"prompt": CELL, "retrieve": st.booleans() | VALUE}),
                st.dictionaries(ROW_NAMES | TEXT, VALUE, max_size=3), VALUE)
COLUMNS = st.dictionaries(ROW_NAMES, st.lists(CELL, min_size=1, max_size=3) | CELL, min_size=1, max_size=3) | \
    st.dictionaries(ROW_NAMES | TEXT, st.lists(VALUE, max_size=3) | VALUE, max_size=3)
PARAMS = st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-1, 9) | VALUE, "temperature": st.floats() | VALUE,
                                             "top_p": st.floats() | VALUE, "seed": st.integers(-2, 2**64) | VALUE,
                                             "sources": st.booleans() | st.integers(-1, 4) | VALUE}) | \
    st.dictionaries(TEXT, VALUE, max_size=2) | VALUE
SPLIT = st.fixed_dictionaries({"columns": st.lists(ROW_NAMES, min_size=1, max_size=3) | VALUE,
                               "data": st.lists(st.lists(CELL, min_size=1, max_size=3) | CELL, min_size=1, max_size=3) | VALUE},
                              optional={"index": st.lists(VALUE, max_size=3) | VALUE}) | \
    st.dictionaries(st.sampled_from(["columns", "data", "index"]) | TEXT, VALUE, max_size=3)
BODY = st.one_of(
    st.fixed_dictionaries({"dataframe_records": st.lists(ROW, min_size=1, max_size=4) | VALUE}, optional={"params": PARAMS}),
    st.fixed_dictionaries({"dataframe_split": SPLIT}, optional={"params": PARAMS}),
    *[st.fixed_dictionaries({form: st.lists(ROW, min_size=1, max_size=4) | COLUMNS | VALUE}, optional={"params": PARAMS})
      for form in ("inputs", "instances")],
    st.dictionaries(st.sampled_from(["dataframe_records", "dataframe_split", "inputs", "instances", "params"]) | TEXT,
                    VALUE, max_size=3),
    VALUE)
NAMED = re.compile(r"(dataframe_records|dataframe_split|inputs|instances|params)\b|send |unknown field|the body ")


@settings(max_examples=300, deadline=None)
@given(BODY)
def test_any_json_body_is_a_request_or_a_refusal_naming_its_field(body):
    """Any JSON value in any field, any code point (lone surrogates as JSON writes them, NULs), as sent
    (JSON text) or as a Python value: a Request within the limits, or a BadRequest naming the field."""
    from monim.serving.request import BadRequest, Limits, loads, parse

    limits = Limits(max_rows=3, max_chars=6, max_new_tokens=5)
    for sent in (json.dumps(body).encode(), None):
        try:
            request = parse(body if sent is None else loads(sent, limits), limits)
        except BadRequest as e:
            assert NAMED.match(str(e)) and json.dumps(str(e)), str(e)
            continue
        assert 1 <= len(request.rows) <= 3 and request.generation.max_new_tokens <= 5
        for (name, value), named in zip(request.rows, request.named):
            assert name in ("text", "prompt") and value.strip() and len(value) <= 6 and value.encode("utf-8")
            assert named.startswith(next(iter(set(body) - {"params"}))) and f".{name}" in named


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["dataframe_records", "dataframe_split", "inputs", "instances", "inputs.", "instances."]),
       st.lists(st.tuples(st.sampled_from(["text", "prompt"]), TEXT), min_size=1, max_size=3))
def test_any_text_in_any_format_is_its_row_or_a_refusal_naming_that_row(form, rows):
    """Rows of any text (lone surrogates, NULs, blanks), sent as JSON in each format ("inputs." is a dict of
    columns): the same rows, or a refusal naming the first bad one's field as that format writes it."""
    from monim.serving.request import BadRequest, Limits, loads, parse

    names = ("text", "prompt")
    if form == "dataframe_split":
        body, where = {form: {"columns": list(names), "data": [[v if n == c else None for c in names] for n, v in rows]}}, \
            "dataframe_split.data[{i}].{n}"
    elif form.endswith("."):
        body, where = {form[:-1]: {c: [v if n == c else None for n, v in rows] for c in names}}, form + "{n}[{i}]"
    else:
        body, where = {form: [{n: v} for n, v in rows]}, form + "[{i}].{n}"
    limits = Limits(max_chars=6)
    bad = [(i, n, "non-empty" if not v.strip() else "characters" if len(v) > 6 else "surrogate")
           for i, (n, v) in enumerate(rows) if not v.strip() or len(v) > 6 or any(0xD800 <= ord(c) < 0xE000 for c in v)]
    try:
        request = parse(loads(json.dumps(body).encode(), limits), limits)
    except BadRequest as e:
        assert bad and str(e).startswith(where.format(i=bad[0][0], n=bad[0][1]) + ": ") and bad[0][2] in str(e), (str(e), bad)
        return
    assert not bad and request.rows == rows


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.builds(lambda n, s: (s * n).encode(errors="surrogatepass"), st.integers(0, 200),
                                          st.sampled_from(["[", "{\"a\":", "[\"]\",", "\"\\ud800\"", "\\"])))
def test_any_body_bytes_are_json_or_a_refusal(raw):
    """Any bytes (deep nesting included: counted before parsing) are JSON or a BadRequest, no other error."""
    from monim.serving.request import BadRequest, Limits, loads

    try:
        loads(raw, Limits())
    except BadRequest as e:
        assert str(e).startswith("the body ")


@pytest.fixture(scope="module")
def served(monim, prefect_api, tiny_model_dir, tmp_path_factory):
    """A work directory learned by `monim learn` (MLflow on), and `monim serve-model` on its champion."""
    from servers import local

    workdir = tmp_path_factory.mktemp("served") / "monim-demo"  # the README's name for it
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_API_URL": prefect_api}
    subprocess.run([monim.script, "learn", "--source", str(DEMO_STREAM), "--start", "1987-03-02", "--end", "1987-03-03",
                    "--policy", "fullmem", "--workdir", str(workdir), "--model", str(tiny_model_dir("llama")),
                    "--max-docs", "3"], env=env, check=True, capture_output=True, timeout=900)
    port, log = local.free_port(), workdir / "server.log"
    proc = subprocess.Popen([monim.script, "serve-model", "--workdir", str(workdir), "--port", str(port), "--max-new-tokens",
                             "200"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    yield port, proc, log, workdir
    if proc.poll() is None:
        proc.kill()


@pytest.mark.slow
def test_the_server_answers_clients_at_once_as_alone_and_errors_in_one_line(served, invoke):
    port, proc, log, _ = served
    bodies = [{"dataframe_records": [{"text": t}, {"prompt": " ".join(t.split()[:6])}], "params": {"max_new_tokens": 4}}
              for t in demo_texts(6, 400)]
    alone = [invoke(port, b) for b in bodies]
    assert all(status == 200 for status, _ in alone), alone
    together = at_once(lambda body: invoke(port, body), bodies)
    for (_, a), (status, b) in zip(alone, together):
        assert status == 200
        (sa, ga), (sb, gb) = a["predictions"], b["predictions"]
        assert sb["ppl"] == pytest.approx(sa["ppl"], rel=1e-5) and gb["tokens"] == ga["tokens"]
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
    assert health["as_of"] in ("1987-03-02", "1987-03-03") and health["limits"]["max_new_tokens"] == 200
    for body, status, says in ((b"{not json", 400, "not JSON"), ({}, 400, "dataframe_records"),
                               ({"dataframe_records": [{"prompt": "x"}], "params": {"max_new_tokens": 500}}, 400, "at most 200"),
                               ({"dataframe_records": [{"text": "x"}], "params": {"max_tokens": 5}}, 400, "'max_tokens'"),
                               ({"dataframe_records": [{"prompt": "x"}], "params": {"sources": True}}, 200, "")):
        got, out = invoke(port, body)
        assert got == status and says in out.get("message", ""), (body, got, out)
        assert "Traceback" not in json.dumps(out) and "DataFrame" not in json.dumps(out)


def same_answers(got: list[dict], want: list[dict]) -> bool:
    """The same rows answered alike: a text's PPL within 1e-5 (scored beside others), a continuation's tokens."""
    return len(got) == len(want) and all(
        g["tokens"] == w["tokens"] and (g["ppl"] == pytest.approx(w["ppl"], rel=1e-5) if "ppl" in w else g["text"] == w["text"])
        for g, w in zip(got, want))


@pytest.mark.slow
def test_the_server_takes_mlflows_four_formats_and_its_scoring_client(served, invoke):
    """MLflow's own scoring client (a DataFrame sent as dataframe_split) and each of MLflow's formats by
    hand get the answers the same rows get as dataframe_records."""
    import pandas as pd
    from mlflow.pyfunc.scoring_server.client import ScoringServerClient

    port = served[0]
    rows = [{"text": t} for t in demo_texts(2, 300)] + [{"prompt": "The bank said"}]
    params = {"max_new_tokens": 4}
    status, want = invoke(port, {"dataframe_records": rows, "params": params})
    assert status == 200, want
    frame = pd.DataFrame(rows)
    assert same_answers(ScoringServerClient("127.0.0.1", port).invoke(frame, params)["predictions"], want["predictions"])
    columns = {k: [r.get(k) for r in rows] for k in ("text", "prompt")}
    for body in ({"dataframe_split": frame.to_dict(orient="split")}, {"inputs": rows}, {"inputs": columns},
                 {"instances": rows}, {"instances": columns}):
        status, out = invoke(port, body | {"params": params})
        assert status == 200 and same_answers(out["predictions"], want["predictions"]), (body, out)


@pytest.mark.slow
def test_the_mlflow_model_takes_what_a_dataframe_takes(served, invoke):
    """The registered pyfunc model, as MLflow loads it, answers a DataFrame, records, a dict of columns and a
    dict of one value each as the server answers the same rows."""
    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    port, _, _, workdir = served
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (name,) = [m.name for m in client.search_registered_models()]
    model = mlflow.pyfunc.load_model(client.get_model_version_download_uri(name, client.get_model_version_by_alias(
        name, "champion").version))
    items = demo_texts(2, 300)
    status, want = invoke(port, {"dataframe_records": [{"text": t} for t in items]})
    assert status == 200, want
    for data in (pd.DataFrame({"text": items}), [{"text": t} for t in items], {"text": items}):
        assert same_answers(model.predict(data), want["predictions"]), data
    assert same_answers(model.predict({"text": items[0]}), want["predictions"][:1])


@pytest.mark.slow
def test_the_server_bounds_what_it_reads_and_every_error_is_its_json_object(served, invoke):
    """A body over the size limit is refused (413) as declared and, chunked, once read that far; one nested
    too deep, or holding a lone surrogate, gets a 400 naming it; a route or method not served a 404/405:
    each the documented JSON object. The server then answers as before, and says it is ok."""
    from servers import client

    port = served[0]
    body = {"dataframe_records": [{"text": demo_texts(1, 300)[0]}]}
    status, before = invoke(port, body)
    limits = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())["limits"]
    assert status == 200 and limits["max_body_bytes"] == 12 * 20_000 * 32 + 65_536 and limits["max_depth"] == 32

    def send(method: str, path: str, headers: dict, chunks=()) -> tuple[int, dict]:
        status, answer = client.send(port, method, path, headers, chunks, timeout=120)
        out = json.loads(answer)
        assert set(out) == {"error_code", "message"}, out
        return status, out

    mib = b" " * (1 << 20)
    status, out = send("POST", "/invocations", {"Content-Length": str(limits["max_body_bytes"] + 1)}, [b"{"])
    assert status == 413 and out["error_code"] == "REQUEST_ENTITY_TOO_LARGE" and str(limits["max_body_bytes"]) in out["message"]
    chunked = [b"%x\r\n%s\r\n" % (len(mib), mib)] * (limits["max_body_bytes"] // len(mib) + 2) + [b"0\r\n\r\n"]
    status, out = send("POST", "/invocations", {"Transfer-Encoding": "chunked"}, chunked)
    assert status == 413 and "max_body_bytes" in out["message"]
    for deep in (b"[" * 200_000, b'{"a":' * 50_000):
        status, out = send("POST", "/invocations", {"Content-Length": str(len(deep))}, [deep])
        assert status == 400 and out["error_code"] == "BAD_REQUEST" and "nests" in out["message"] and "at most 32" in out["message"]
    surrogate = b'{"dataframe_records": [{"text": "Oil prices \\ud800 rose"}]}'
    status, out = send("POST", "/invocations", {"Content-Length": str(len(surrogate))}, [surrogate])
    assert status == 400 and out["message"].startswith("dataframe_records[0].text: a lone surrogate")
    assert send("GET", "/nowhere", {})[0] == 404 and send("GET", "/invocations", {})[0] == 405
    status, after = invoke(port, body)
    assert status == 200 and after == before
    assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())["status"] == "ok"


@pytest.mark.slow
def test_an_abandoned_request_stops_and_a_sigterm_stops_the_server(served, invoke):
    import psutil

    port, proc, log, _ = served
    long = {"dataframe_records": [{"prompt": p} for p in ("The bank", "Oil prices", "The company")],
            "params": {"max_new_tokens": 200}}
    busy = threading.Thread(target=invoke, args=(port, long))  # Θ's worker is busy for a while
    busy.start()
    time.sleep(0.2)
    with pytest.raises(OSError):  # this client gives up waiting: its continuation stops at its next token
        invoke(port, {"dataframe_records": [{"prompt": "The bank said"}], "params": {"max_new_tokens": 200}}, timeout=0.3)
    busy.join()
    deadline = time.monotonic() + 30
    while not re.search(r"stopped after \d+ tokens: caller gone|dropped before it ran", log.read_text()):
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    flying = threading.Thread(target=lambda: invoke(port, long, timeout=60))
    flying.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)  # stops within 10 s, a request in flight
    flying.join()
    assert not [p for p in children if p.is_running()]
