"""The local servers monim starts: the Prefect API of one command, and the Prefect and MLflow
servers of `monim serve` and `monim ui`. Each is tied to the monim process that started it: it is
stopped when monim exits, and on Linux the kernel stops it if monim dies (even by kill -9)."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import NoReturn

from monim.core.atomic import out_of_room, sqlite_damage
from monim.core.lock import hold

BIN = Path(sys.executable).parent


def free_port(preferred: int | None = None) -> int:
    """The preferred port if nothing listens there, else any free one."""
    if preferred:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", preferred)) != 0:
                return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dies_with(parent: int):
    """A child's preexec: the kernel sends it SIGTERM when `parent` dies (Linux PR_SET_PDEATHSIG)."""

    def preexec() -> None:
        if sys.platform == "linux":
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before prctl
                os._exit(0)

    return preexec


def start(cmd: list[str], health: str, timeout: float = 120, env: dict | None = None) -> subprocess.Popen:
    """Start a server in its own session (Ctrl-C reaches monim, which stops it) that dies with this
    process, and wait until it answers."""
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"} | (env or {})
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_dies_with(os.getpid()))
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(cmd[0]).name} exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(health, timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    stop([proc])
    raise RuntimeError(f"{health} did not answer within {timeout:.0f} s")


def prefect_server(port: int) -> subprocess.Popen:
    """A Prefect server (API and UI) on 127.0.0.1:port, once it answers."""
    api = f"http://127.0.0.1:{port}/api"  # the UI's own: else it calls the default port's API
    return start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 f"{api}/health", env={"PREFECT_UI_API_URL": api})


def prefect_api(attempts: int = 3) -> str:
    """A Prefect API for this process alone (what Prefect's temporary server is, without its UI),
    stopped when this process exits or dies; its URL. Two commands on one work directory share its
    database: they start their APIs one after the other (the first creates the schema)."""
    env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    if (db := home / "prefect.db").exists() and (damage := sqlite_damage(db)):
        if why := out_of_room(db):  # it cannot be read for want of room (its journal), not damaged
            raise RuntimeError(f"Prefect's API did not start ({damage}): {why}")
        raise RuntimeError(f"{db}: Prefect's database is damaged ({damage}); move it aside (mv {db} {db}.damaged): "
                           "the memories and MLflow do not depend on it")
    with hold(home / ".api-start.lock"):
        for attempt in range(attempts):
            port = free_port()
            try:
                proc = start([sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                              "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
                             f"http://127.0.0.1:{port}/api/health", env=env)
                break
            except RuntimeError as e:  # e.g. the port was taken meanwhile
                if attempt == attempts - 1:
                    why = out_of_room(db)  # its database cannot grow: say so, not only the server's exit status
                    raise RuntimeError(f"Prefect's API did not start ({e}){f': {why}' if why else ''}") from e
    atexit.register(stop, [proc])
    global own_api
    own_api = f"http://127.0.0.1:{port}/api"
    return own_api


own_api: str | None = None  # the Prefect API prefect_api started for this process


def private_api() -> bool:
    """Whether the Prefect API this process talks to is the one it started (its database is this work directory's)."""
    return own_api is not None and os.environ.get("PREFECT_API_URL") == own_api


def mlflow_server(port: int, workdir: Path) -> subprocess.Popen:
    """An MLflow server over the work directory's SQLite store and artifacts, once it answers."""
    from tracking.store import ensure_store  # not at the top: MLflow loads where a server starts

    store = f"sqlite:///{(workdir / 'mlflow.db').resolve()}"
    ensure_store(store)
    return start([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                  "--backend-store-uri", store,
                  "--artifacts-destination", str((workdir / "mlartifacts").resolve())],
                 f"http://127.0.0.1:{port}/health")


GRACE = 8.0  # seconds a stop may take before the process ends itself (commits are atomic: nothing is lost)
STOPPING_WAIT = 3.0  # seconds a stopped command gives its servers to end before killing them


def interruptible() -> None:
    """Ctrl-C or a kill (SIGTERM) raise KeyboardInterrupt, so the servers monim started are stopped;
    whatever swallows it, the process ends GRACE seconds after the signal."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)


def _stop(signum: int, frame) -> None:
    _end_soon(signum)
    raise KeyboardInterrupt


def _end_soon(signum: int) -> None:
    """End the process GRACE seconds from now (once), unless it has ended by then: a stop that code on
    the way swallowed (a signal delivered inside a finalizer or a callback) still stops."""
    global _ending
    if _ending is None:
        _ending = threading.Timer(GRACE, os._exit, [128 + signum])  # its children die with it (PR_SET_PDEATHSIG)
        _ending.daemon = True
        _ending.start()


def _end_now() -> None:
    """A stopped command, once its other exit handlers have run, ends without the interpreter's teardown:
    collecting the garbage of torch, Prefect and MLflow takes seconds on 2 cores, and no timer can end
    a process then."""
    if _ending is not None:
        end_at_once(list(_ending.args)[0])


def end_at_once(status: int) -> NoReturn:
    """End the process now, its output and logs written, skipping the interpreter's teardown."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_ending: threading.Timer | None = None
atexit.register(_end_now)  # at import, before Prefect's and MLflow's handlers: so it runs after them


def guard_prefect_stops() -> None:
    """While a flow runs, Prefect's own SIGTERM handler is installed (it raises TerminationSignal,
    which can be swallowed: a run went on to its end): it is made to set the same deadline first."""
    from prefect.utilities import engine

    original = engine._prefect_sigterm_handler
    if getattr(original, "ends_soon", False):
        return

    def handler(sig_num: int, *args: object) -> NoReturn:  # Prefect's handler's signature
        _end_soon(sig_num)
        original(sig_num, *args)

    setattr(handler, "ends_soon", True)
    engine._prefect_sigterm_handler = handler


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT, then a kill after 20 s; once this process is being stopped, SIGTERM (a server then ends at once,
    its SQLite database whole) and a kill after STOPPING_WAIT."""
    stopping = _ending is not None
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM if stopping else signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=STOPPING_WAIT if stopping else 20)
        except subprocess.TimeoutExpired:
            p.kill()
