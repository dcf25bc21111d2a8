"""Real servers on loopback: a Prefect server running a deployment through a process worker, and
an MLflow tracking server receiving a stream's metrics over HTTP. Both are bounded and stopped."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from monim.core.config import DEMO_STREAM
from monim.core.run_config import RunConfig

pytestmark = pytest.mark.slow  # starts Prefect and MLflow servers

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(cmd: list[str], health: str, env: dict, log: Path, timeout: float = 120):
    """Start a server, wait until `health` answers, stop it (SIGINT, then kill) afterwards."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, f"{cmd[0]} exited early:\n{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(health, timeout=2)
                break
            except OSError:
                assert time.time() < deadline, f"{health} not healthy in {timeout} s:\n{log.read_text()[-3000:]}"
                time.sleep(1)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(cmd: list, env: dict, timeout: float = 300) -> str:
    proc = subprocess.run(list(map(str, cmd)), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_deployment_runs_through_a_process_worker(tiny_model_dir, tmp_path):
    port = free_port()
    env = os.environ | {"PREFECT_HOME": str(tmp_path / "prefect")}
    with server([BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                f"http://127.0.0.1:{port}/api/health", env, tmp_path / "server.log"):
        api = env | {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "MONIM_REPO": str(REPO),
                     "MONIM_SOURCE": str(DEMO_STREAM), "MONIM_WORKDIR": str(tmp_path / "work")}
        run([BIN / "prefect", "work-pool", "create", "monim-process", "--type", "process"], api)
        out = run([BIN / "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"], api)
        assert "monim-yesterday/daily" in out and "monim-stream/backfill" in out
        spec = {"source": str(DEMO_STREAM), "workdir": str(tmp_path / "work"), "model": str(tiny_model_dir("gpt2")),
                "max_docs": 2}  # a run's settings are one JSON parameter (in the UI, a form)
        out = run([BIN / "prefect", "deployment", "run", "monim-stream/backfill", "--param", "start=1987-03-02",
                   "--param", "end=1987-03-02", "--param", f"run={json.dumps(spec)}"], api)
        run([BIN / "prefect", "worker", "start", "--pool", "monim-process", "--run-once"], api, timeout=400)
        check = ("import asyncio\nfrom prefect.client.orchestration import get_client\n"
                 "async def main():\n    async with get_client() as c:\n"
                 "        runs = await c.read_flow_runs()\n        print(sorted((r.name.split('-')[0], r.state_type.value) for r in runs))\n"
                 "asyncio.run(main())")
        states = run([sys.executable, "-c", check], api)
        assert "COMPLETED" in states and "FAILED" not in states and "CRASHED" not in states, states
        assert (tmp_path / "work" / "memories" / "monim-amt" / "manifest.json").is_file()
        assert "'SCHEDULED'" in states  # the daily deployment's cron schedule created upcoming runs


def test_stream_logs_to_an_mlflow_server_over_http(prefect, tiny_model_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.stream import learn_stream

    port = free_port()
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [BIN / "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination", str(tmp_path / "artifacts")]
    uri = f"http://127.0.0.1:{port}"
    with server(list(map(str, cmd)), f"{uri}/health", env, tmp_path / "mlflow.log"):
        run = RunConfig(source=str(DEMO_STREAM), policy="fullmem", workdir=str(tmp_path / "work"),
                        model=str(tiny_model_dir("gpt2")), max_docs=1)
        learn_stream(run, "1987-03-02", "1987-03-03", tracking_uri=uri, experiment="over-http")
        client = MlflowClient(uri)
        (run_info,) = client.search_runs([client.get_experiment_by_name("over-http").experiment_id])
        assert [m.step for m in client.get_metric_history(run_info.info.run_id, "2_learned/memrate")] == [0, 1]
        assert "days.csv" in {a.path for a in client.list_artifacts(run_info.info.run_id)}
    assert not (tmp_path / "work" / "mlflow.db").exists()  # nothing went to the local default


def test_monim_ui_starts_both_uis_and_stops_them(monim, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    log = tmp_path / "ui.log"
    ports = [free_port(), free_port()]
    with open(log, "w") as out:
        proc = subprocess.Popen([monim.script, "ui", "--workdir", str(tmp_path), "--prefect-port", str(ports[0]),
                                 "--mlflow-port", str(ports[1])], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while "Ctrl-C" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/api/health", timeout=5)
        urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/health", timeout=5)
        assert f"http://127.0.0.1:{ports[0]}" in log.read_text() and f"http://127.0.0.1:{ports[1]}" in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    for port in ports:  # both servers are gone
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)


def test_monim_serve_runs_the_daily_deployment_on_its_schedule(monim, tmp_path):
    """A per-minute cron: within two minutes the schedule creates a run and it completes (the demo feed
    ended in 1987: a lag allowed past that, else the run fails as stalled)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    log, port = tmp_path / "serve.log", free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([monim.script, "serve", "--source", str(DEMO_STREAM), "--workdir", str(tmp_path),
                                 "--cron", "* * * * *", "--prefect-port", str(port), "--max-feed-lag", "100000"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while "for flow 'monim-yesterday'" not in log.read_text() or "Finished in state Completed" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline and "FeedStalled" not in log.read_text(), \
                log.read_text()[-3000:]
            time.sleep(2)
        servers = [" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True)]
        servers = [c for c in servers if "prefect" in c and "server" in c]  # one Prefect API: the announced one
        assert len(servers) == 1 and f"--port {port}" in servers[0], servers
        assert "temporary server" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    with pytest.raises(OSError):  # the Prefect server monim started is gone too
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
    assert (tmp_path / "mlflow.db").is_file()  # the scheduled run tracked into this work directory
