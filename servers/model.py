"""`monim serve-model`: a registered Θ (the champion, or a version) answering HTTP on one process.

The same pyfunc model `mlflow models serve` loads (tracking.served_model.MonimModel), behind monim's own
small FastAPI app rather than MLflow's scoring server, because the app can: read a body no further
than its limits (bytes, nesting); refuse unknown fields and params by name and answer every error,
its own and FastAPI's, as one JSON object without a trace or a dataframe dump;
stop a request's work when its caller disconnects; stop cleanly, being one process (SIGTERM or
Ctrl-C: no new requests, in-flight ones finished or stopped at their next token, within seconds);
and follow the champion: a Follower checks the alias every few seconds, loads a new champion in
the background while the served one answers, and the worker swaps between requests (MLflow's
server loads its model once).
Routes: GET /ping (ready; 503 while the served files differ from their commit), GET /health (what is
served, since when, the champion last seen), GET /version (monim's, the LM's, Θ's), POST /invocations;
each answer is a model of servers.schema, which FastAPI's schema (the HTTP reference) is made of.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from http import HTTPStatus
from typing import Callable, Mapping

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from monim import __version__
from monim.serving.request import BadRequest, loads
from monim.serving.service import Busy, Service, now
from monim.theta.memory import Memory
from servers import schema
from servers.examples import EXAMPLES

log = logging.getLogger("monim.server")
SERVED = ("model", "version", "as_of", "memory", "checksum")  # what a version is, as /health shows it


class Follower:
    """Keeps a Service on the version an alias points to: every `every` seconds `find()` says which
    version that is; a new one is loaded by `load(version)` on this thread while the served one
    answers, then handed to the service whole. A version that cannot be loaded leaves the last good
    one serving (logged, and shown by /health), and is tried again once the alias moves, or after
    RETRY_S (a damaged file may be repaired in place): a load takes the cores the answers need."""

    RETRY_S = 300.0

    def __init__(self, service: Service, find: Callable[[], dict], load: Callable[[dict], Memory], every: float):
        self.service, self.find, self.load, self.every = service, find, load, every
        self.checked_at: str | None = None
        self.champion: dict | None = None  # the version the alias pointed to at the last check
        self.handed = {k: service.about.get(k) for k in SERVED}  # the version last handed to the service
        self.error: str | None = None  # why the alias's version is not served (it could not be found or loaded)
        self._refused: tuple[dict, float] | None = None  # the version that could not be loaded, and when to try again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monim-follow", daemon=True)

    def start(self) -> Follower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """One look at the alias; a new version loaded and swapped in: whether the served one changed."""
        try:
            found = self.find()
        except Exception as e:  # noqa: BLE001 (a registry that cannot be read now: keep serving, look again)
            return self._failed(f"the registry could not be read: {type(e).__name__}: {e}")
        self.checked_at, self.champion = now(), {k: found.get(k) for k in SERVED}
        if self.champion == self.handed:
            self.error = None
            return False
        if self._refused is not None and self._refused[0] == self.champion and time.monotonic() < self._refused[1]:
            return False
        log.warning("the champion is now %s version %s (Θ as of %s): loading it", found["model"], found["version"],
                    found["as_of"])
        try:
            memory = self.load(found)
        except Exception as e:  # noqa: BLE001
            self._refused = (self.champion, time.monotonic() + self.RETRY_S)
            return self._failed(f"version {found['version']} could not be loaded: {type(e).__name__}: {e}; still "
                                f"serving version {self.service.about.get('version')}")
        self.error, self.handed, self._refused = None, self.champion, None
        self.service.swap(memory, self.champion)
        return True

    def _failed(self, why: str) -> bool:
        if why != self.error:
            log.error("%s", why)
        self.error = why
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def health(self) -> dict:
        """What /health says of the alias: when it was last checked, what it points to, what went wrong."""
        return {"follows": "champion", "checked_every_s": self.every, "checked_at": self.checked_at,
                "champion": self.champion, "error": self.error}


NOT_FOLLOWING = dict.fromkeys(("follows", "checked_every_s", "checked_at", "champion", "error"))  # --version N


def health_of(service: Service, follower: Follower | None) -> dict:
    """/health's answer: "damaged" while the served files differ from their commit (nothing is
    answered: 503), "failing" while Θ's answers fail, "stale" while the champion cannot be served
    (the last good version answers), else "ok"; what is served, since when, and the limits."""
    following = follower.health() if follower is not None else NOT_FOLLOWING
    damaged = service.look()
    status = "damaged" if damaged else "failing" if service.failing else "stale" if following["error"] else "ok"
    return ({"status": status, "problem": damaged or service.failing or following["error"]} | service.about
            | following | {"limits": service.limits.__dict__})


def app_for(service: Service | None, follower: Follower | None = None) -> FastAPI:
    """The HTTP face of a Service (and of the Follower that keeps it on the champion, if any); its
    schema at /openapi.json (the body is checked by the service, which names the field it refuses)."""
    def served() -> Service:
        """The service (None only where the app is made for its schema, never asked)."""
        if service is None:
            raise RuntimeError("no model is served: this app was made for its schema only")
        return service

    app = FastAPI(title="monim: the up-to-date model", version=__version__, docs_url=None, redoc_url=None,
                  description="Θ (the LM, its memory and calibrator) as of a registered day, answering MLflow's scoring format.")

    @app.get("/ping", summary="Ready: 200 once the model is loaded, 503 while its files are damaged",
             response_model=schema.Ping, responses={503: {"model": schema.Ping, "description": "Damaged"}})
    def ping(response: Response) -> dict:
        damaged = service.look() if service is not None else None
        response.status_code = 503 if damaged else 200
        return {"status": "damaged" if damaged else "ok", "problem": damaged}

    @app.get("/health", summary="What is served, since when, the champion last seen, the limits",
             response_model=schema.Health)
    def health() -> dict:
        return health_of(served(), follower)

    @app.get("/version", summary="monim's version, the LM, and the version of Θ served", response_model=schema.Served)
    def version() -> dict:
        live = served()
        return {k: live.about.get(k) for k in schema.Version.model_fields} | {
            "monim": __version__, "lm": live.memory.lm.name}

    @app.post("/invocations", summary="Score texts and continue prompts with Θ", response_model=schema.Predictions,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/Invocation"}}}}},
              responses={status: {"model": schema.Error} for status in (400, 413, 500, 503)})
    async def invocations(request: Request) -> Response | dict:
        answering = served()
        limits = answering.limits
        try:
            raw = await _read(request, limits.max_body_bytes or 0)  # never 0: ServiceLimits sets it
        except ClientDisconnect:  # no one to answer, nothing to log
            return _error(400, "BAD_REQUEST", "the caller left before its body was read")
        if raw is None:
            return _error(413, "REQUEST_ENTITY_TOO_LARGE", f"the body is larger than {limits.max_body_bytes} bytes "
                          f"(max_body_bytes: room for {limits.max_rows} rows of {limits.max_chars} characters)")
        gone = threading.Event()
        watcher = asyncio.create_task(_watch(request, gone))
        try:
            body = await run_in_threadpool(loads, raw, limits)
            answers = await run_in_threadpool(answering.answer, body, gone.is_set)
        except BadRequest as e:
            return _error(400, "BAD_REQUEST", str(e))
        except Busy as e:
            return _error(503, "BUSY", str(e))
        except Exception as e:  # noqa: BLE001 (the trace goes to the server's log, the message to the caller)
            log.exception("request failed")
            return _error(500, "INTERNAL_ERROR", f"{type(e).__name__}: {e}")
        finally:
            watcher.cancel()
        return {"predictions": answers}

    @app.exception_handler(StarletteHTTPException)
    async def refused(request: Request, e: StarletteHTTPException) -> Response:  # a route or method not served
        return _error(e.status_code, HTTPStatus(e.status_code).name, str(e.detail), e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return _error(422, "UNPROCESSABLE_ENTITY", str(e.errors())[:500])

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> Response:  # then re-raised: uvicorn logs the trace
        return _error(500, "INTERNAL_ERROR", f"{type(e).__name__}: {e}")

    app.openapi = lambda: _documented(app)  # type: ignore[method-assign]  # FastAPI's way to change the schema
    return app


def _documented(app: FastAPI) -> dict:
    """FastAPI's schema of the app, with the request body it documents (read by the service itself) and
    the real requests and answers of servers.examples."""
    if app.openapi_schema is None:
        spec = FastAPI.openapi(app)
        body = schema.Invocation.model_json_schema(ref_template="#/components/schemas/{model}")
        spec.setdefault("components", {}).setdefault("schemas", {}).update(body.pop("$defs") | {"Invocation": body})
        for name, example in EXAMPLES.items():
            route, shown = spec["paths"][example.path][example.method], {"summary": example.summary}
            if example.request is not None:
                content = route["requestBody"]["content"]["application/json"]
                content.setdefault("examples", {})[name] = shown | {"value": example.request}
            content = route["responses"][str(example.status)]["content"]["application/json"]
            content.setdefault("examples", {})[name] = shown | {"value": example.answer}
        app.openapi_schema = spec
    return app.openapi_schema


def openapi() -> dict:
    """The served model's OpenAPI schema (no model loaded), for the documentation."""
    return app_for(None).openapi()


async def _watch(request: Request, gone: threading.Event) -> None:
    """Set `gone` when the caller disconnects (its work is then stopped)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    gone.set()


async def _read(request: Request, limit: int) -> bytes | None:
    """The body, or None once it is longer than `limit` bytes, as declared (Content-Length) or as read
    (a chunked body): reading stops there."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """Every error the server answers: one JSON object (ASCII: a message may quote a lone surrogate)."""
    return Response(json.dumps({"error_code": code, "message": message}), status, headers, "application/json")


class _Server(uvicorn.Server):
    """Uvicorn's server that, at SIGTERM or Ctrl-C, first tells Θ's worker to stop (a continuation in
    flight ends at its next token and is answered; a request not started yet is refused)."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.stop()
        super().handle_exit(sig, frame)


def serve(service: Service, follower: Follower | None = None, host: str = "127.0.0.1", port: int = 5001) -> None:
    """Answer on host:port until SIGTERM or Ctrl-C, then stop within seconds (in-flight requests finish or stop)."""
    config = uvicorn.Config(app_for(service, follower), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5, access_log=False)
    if follower is not None:
        follower.start()
    try:
        _Server(config, service).run()
    finally:
        if follower is not None:
            follower.stop()
        service.close()
