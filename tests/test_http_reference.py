"""The HTTP reference is what the server answers: every answer (a text row, a prompt row, a prompt row
with retrieval, /health following or not, /ping, /version, each error) is exactly its schema model, no
field more or less; and every example the reference shows, sent to the app on loopback over a small real
memory (the tiny LM), gets an answer of the documented status and shape."""

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest


def exactly(model, answer: dict) -> None:
    """The answer is its model field for field: a field the model does not declare, one it declares
    but the answer lacks (a default filled in), or a value of another type fails."""
    assert model.model_validate(answer).model_dump(mode="json") == answer, (model.__name__, answer)


def same_shape(a, b) -> bool:
    """The same fields at every depth (a list's items each alike; null stands for any value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_shape(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return all(same_shape(x, y) for x in a for y in b)
    return a is None or b is None or type(a) is type(b)


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(theta):
    """The app over the memory on loopback, following a champion that is the version served."""
    import uvicorn

    from monim.serving.service import Service
    from servers.local import free_port
    from servers.model import Follower, app_for

    about = {"model": "monim-demo-fullmem", "version": "1", "as_of": theta.days[-1].date, "memory": str(theta.ds.root),
             "checksum": theta.checksum()}
    service = Service(theta, about=about)
    follower = Follower(service, lambda: about, lambda found: pytest.fail("nothing new to load"), every=3600)
    follower.check()
    port = free_port()
    app = uvicorn.Server(uvicorn.Config(app_for(service, follower), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=app.run, daemon=True)
    thread.start()
    while not app.started:
        assert thread.is_alive()
        time.sleep(0.05)
    yield port, service, follower
    app.should_exit = True
    thread.join(timeout=30)
    service.close()


def test_every_answer_is_exactly_its_model(server, invoke):
    """The service's answers to each row kind, /health with and without a champion to follow, /ping and
    /version: each exactly its model; a prompt's `sources` holds the retrieved article only when asked."""
    from servers import schema
    from servers.model import health_of

    port, service, follower = server
    rows = [{"text": "Oil prices rose sharply on Monday."}, {"prompt": "The bank said"},
            {"prompt": "The bank said", "retrieve": True}]
    answers = service.answer({"dataframe_records": rows, "params": {"max_new_tokens": 4}})
    exactly(schema.Predictions, {"predictions": answers})
    score, plain, retrieved = answers
    assert set(score) == set(schema.Score.model_fields) and set(plain) == set(schema.Continuation.model_fields)
    assert plain["sources"] == [] and len(retrieved["sources"]) == 1 and len(plain["tokens"]) == 4
    status, out = invoke(port, {"dataframe_records": rows, "params": {"max_new_tokens": 4}})
    assert status == 200 and out == {"predictions": answers}
    exactly(schema.Health, health_of(service, follower))
    pinned = health_of(service, None)  # `--version N`: nothing followed
    exactly(schema.Health, pinned)
    assert pinned["follows"] is None and pinned["champion"] is None and pinned["status"] == "ok"
    for path, model in (("/health", schema.Health), ("/ping", schema.Ping), ("/version", schema.Served)):
        status, out = get(port, path)
        assert status == 200, out
        exactly(model, out)
    assert get(port, "/version")[1] == {"monim": __import__("monim").__version__, "lm": service.memory.lm.name,
                                        "model": "monim-demo-fullmem", "version": "1", "as_of": service.about["as_of"]}


def test_every_example_of_the_reference_is_answered_in_its_shape(server, invoke, theta):  # noqa: F811
    """Each documented answer is exactly the model the schema names for its route and status, and each
    documented request, sent, gets that status and an answer of the documented shape (a refusal's message
    word for word; a damaged memory's once a served file is rewritten, then put back)."""
    from servers import client, schema
    from servers.examples import EXAMPLES
    from servers.model import openapi

    port = server[0]
    spec = openapi()
    prompt = EXAMPLES["prompt"].request["dataframe_records"][0]["prompt"]
    assert [e.request["dataframe_records"] for e in map(EXAMPLES.get, ("text", "prompt", "retrieve"))] == [
        [{"text": EXAMPLES["text"].request["dataframe_records"][0]["text"]}], [{"prompt": prompt}],
        [{"prompt": prompt, "retrieve": True}]]  # one row of each kind
    assert {(e.path, e.status) for e in EXAMPLES.values() if e.method == "get"} == {
        ("/health", 200), ("/ping", 200), ("/ping", 503), ("/version", 200)}

    def sent(example) -> tuple[int, dict]:
        if example.method == "get":
            return get(port, example.path)
        if example.request is None:  # too large to show: its declared length is over the limit
            status, answer = client.send(port, "POST", example.path, {"Content-Length": "7745537"}, [b"{"])
            return status, json.loads(answer)
        return invoke(port, example.request)

    healthy = {n: e for n, e in EXAMPLES.items() if e.status != 503}
    damaged = {n: e for n, e in EXAMPLES.items() if e.status == 503}
    assert set(damaged) == {"damaged", "ping_damaged"}
    values = theta.ds.root / "shards" / theta.ds.days[0].shard / "values.npy"
    good = values.read_bytes()
    for group in (healthy, damaged):
        if group is damaged:
            np.save(values, np.load(values)[::-1].copy())
            while get(port, "/ping")[0] != 503:
                time.sleep(0.2)
        try:
            for name, example in group.items():
                content = spec["paths"][example.path][example.method]["responses"][str(example.status)]["content"]
                model = getattr(schema, content["application/json"]["schema"]["$ref"].split("/")[-1])
                assert content["application/json"]["examples"][name]["value"] == example.answer
                exactly(model, example.answer)
                if name == "failed":  # no request makes Θ fail: the answer's form only
                    continue
                status, answer = sent(example)
                assert status == example.status, (name, answer)
                exactly(model, answer)
                assert same_shape(answer, example.answer), (name, answer, example.answer)
                if status in (400, 413):
                    assert answer == example.answer
                if status == 503:
                    assert f"{values}: written since it was verified" in json.dumps(answer, ensure_ascii=False)
        finally:
            if group is damaged:
                values.write_bytes(good)
    while get(port, "/ping")[0] != 200:  # put back: answered again
        time.sleep(0.2)


def test_the_serve_guide_shows_the_examples_requests_and_answers():
    """The serve guide's curl commands send the reference's example requests, and its outputs show their
    answers (the guide's run is where the examples come from)."""
    import re
    from pathlib import Path

    from servers.examples import EXAMPLES

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "serve.md").read_text()
    sent = [json.loads(body) for body in re.findall(r"-d '(.*?)'", guide)]
    shown = [json.loads(line) for block in re.findall(r"```text\n(.*?)```", guide, re.S)
             for line in block.splitlines() if line.startswith("{")]
    for name in ("text", "prompt", "retrieve", "refused"):
        assert EXAMPLES[name].request in sent and EXAMPLES[name].answer in shown, name
