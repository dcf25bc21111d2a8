"""`monim serve-model`: a registered Θ (the champion, or a version) answering HTTP on one process.

The same pyfunc model `mlflow models serve` loads (tasks.registry.MonimModel), behind monim's own
small FastAPI app rather than MLflow's scoring server, because the app can: refuse unknown fields
and params by name and answer every error as one JSON line without a trace or a dataframe dump;
stop a request's work when its caller disconnects; and stop cleanly, being one process (SIGTERM or
Ctrl-C: no new requests, in-flight ones finished or stopped at their next token, within seconds).
Routes: GET /ping (ready), GET /health (what is served, the limits), POST /invocations.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from monim.serving import BadRequest, Busy, Service

log = logging.getLogger("monim.server")


def app_for(service: Service, about: dict) -> FastAPI:
    """The HTTP face of a Service; `about` says what is served (model, version, day)."""
    app = FastAPI(title="monim", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/ping")
    def ping() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse({"status": "ok"} | about | {"limits": service.limits.__dict__})

    @app.post("/invocations")
    async def invocations(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError as e:
            return _error(400, "BAD_REQUEST", f"the body is not JSON: {e}")
        gone = threading.Event()
        watcher = asyncio.create_task(_watch(request, gone))
        try:
            answers = await run_in_threadpool(service.answer, body, gone.is_set)
        except BadRequest as e:
            return _error(400, "BAD_REQUEST", str(e))
        except Busy as e:
            return _error(503, "BUSY", str(e))
        except Exception as e:  # noqa: BLE001 (the trace goes to the server's log, the message to the caller)
            log.exception("request failed")
            return _error(500, "INTERNAL_ERROR", f"{type(e).__name__}: {e}")
        finally:
            watcher.cancel()
        return JSONResponse({"predictions": answers})

    return app


async def _watch(request: Request, gone: threading.Event) -> None:
    """Set `gone` when the caller disconnects (its work is then stopped)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    gone.set()


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error_code": code, "message": message}, status_code=status)


class _Server(uvicorn.Server):
    """Uvicorn's server that, at SIGTERM or Ctrl-C, first tells Θ's worker to stop (a continuation in
    flight ends at its next token and is answered; a request not started yet is refused)."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.stop()
        super().handle_exit(sig, frame)


def serve(service: Service, about: dict, host: str = "127.0.0.1", port: int = 5001) -> None:
    """Answer on host:port until SIGTERM or Ctrl-C, then stop within seconds (in-flight requests finish or stop)."""
    config = uvicorn.Config(app_for(service, about), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5, access_log=False)
    try:
        _Server(config, service).run()
    finally:
        service.close()
