"""The fault drills, whole (`make soak`; left out of `make test` and `make test-fast`): `monim learn` killed
with SIGKILL at random moments and resumed, and what a daily job meets, run against fresh work directories
with the `monim` command as from a fresh shell (each command starts its own Prefect API)."""

import datetime as dt
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from helpers import chaos, demo_rows, learn, write_feed
from monim.storage.datastore import Datastore

pytestmark = [pytest.mark.soak, pytest.mark.slow]
DAYS = ["1987-03-02", "1987-03-03", "1987-03-04", "1987-03-05"]
BAD = ("silent", "traceback", "lost")  # the failures the faults drill exists to find


def test_chaos_kills_leave_the_memory_of_an_uninterrupted_run(monim, tmp_path):
    """20 SIGKILLs of MoNIM-AMT learning 5 demo days (3 articles a day, the default LM): the memory an
    uninterrupted run makes, byte for byte, a clean `monim fsck`, each day once in MLflow."""
    result = chaos(monim, tmp_path, kills=20)
    print(json.dumps({k: v for k, v in result.items() if k != "fsck"}, indent=1))
    assert result["identical"] and result["fsck_clean"], (result["differ"], result["fsck"])
    assert result["kills"] == 20


def feed(path: Path, days: int = 3, per_day: int = 3, extra: tuple = ()) -> Path:
    """The demo's first `per_day` articles of each of its first `days` days, then `extra` records."""
    return write_feed(path, [*demo_rows(days, per_day), *extra])


class Faults:
    """The drill's rows: one per fault, with the command's exit status, its message and the verdict."""

    def __init__(self, monim, model: Path):
        self.monim, self.model, self.rows = monim, model, []

    def run(self, *args) -> subprocess.CompletedProcess:
        return self.monim(*args, check=False, own_api=True)

    def learn(self, source: Path, workdir: Path, *more) -> subprocess.CompletedProcess:
        return learn(self.monim, source, workdir, self.model, *more, own_api=True)

    def note(self, fault: str, proc: subprocess.CompletedProcess | None, ok: bool, expect: str) -> None:
        """A row: refused (non-zero, one clear line), handled (zero, memory as expected), or what failed."""
        code = None if proc is None else proc.returncode
        errors = [] if proc is None else [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
        if proc is not None and "Traceback" in proc.stderr:
            verdict = "traceback"
        elif not ok:
            verdict = "lost" if expect == "handled" else "silent"
        elif expect == "refused":
            verdict = "refused" if code not in (0, None) and len(errors) == 1 else "silent"
        else:
            verdict = "handled"
        last = [] if proc is None else proc.stdout.strip().splitlines()[-1:]
        message = errors[0][7:] if errors else (last or [""])[0]
        self.rows.append({"fault": fault, "exit": code, "verdict": verdict, "message": message[:220]})


def last_json(p: subprocess.CompletedProcess) -> dict:
    """The JSON a command printed last ({} if it printed none)."""
    try:
        return json.loads(p.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        return {}


def arrays(workdir: Path) -> tuple[list[str], dict]:
    ds = Datastore.read(workdir / "memories" / "fullmem")
    return [d.date for d in ds.days], {a: ds.shards.array(a) for a in ("keys", "values", "positions")}


def same(a: Path, b: Path) -> bool:
    import numpy as np

    (da, xa), (db, xb) = arrays(a), arrays(b)
    return da == db and all(np.array_equal(xa[k], xb[k]) for k in xa)


def prefix(a: Path, clean: Path) -> bool:
    """Whole days from the first, each what the clean run stored."""
    import numpy as np

    if not (a / "memories" / "fullmem" / "manifest.json").exists():
        return True
    (da, xa), (dc, xc) = arrays(a), arrays(clean)
    n = sum(d.entries for d in Datastore.read(a / "memories" / "fullmem").days)
    return da == dc[: len(da)] and all(np.array_equal(xa[k], xc[k][:n]) for k in xa)


def test_what_a_daily_job_meets_is_refused_or_handled(monim, tiny_model_dir, tmp_path):
    """Bad records, stops, a changed model or window, damaged files, bad input (docs/results/faults.md): each
    refused (a non-zero exit, one line naming what is wrong, the memory unchanged) or handled (the command went
    on, or was repaired, and the memory equals a clean run's); none silent, a traceback or lost."""
    root, model = tmp_path, tiny_model_dir("llama")
    b = Faults(monim, model)
    clean = root / "clean"
    source = feed(root / "feed.jsonl")
    assert b.learn(source, clean).returncode == 0

    # dates
    future = {"id": "x", "date": (dt.date.today() + dt.timedelta(days=400)).isoformat(), "text": "From later."}
    late = feed(root / "late.jsonl", extra=(future,))
    p = b.learn(late, root / "late")
    b.note("a record dated after today, at the end of the feed", p, not (root / "late" / "memories").exists(), "refused")
    p = b.learn(late, root / "late", "--on-error", "skip")
    b.note("the same, --on-error skip", p, p.returncode == 0 and same(root / "late", clean), "handled")
    b.run("forget", "--workdir", root / "late", "--day", DAYS[2])
    p = b.learn(late, root / "late", "--on-error", "skip")  # a forgotten day is not learned again unless asked
    b.note("a bad last day undone (forget --day): learn leaves it out", p,
           p.returncode == 0 and arrays(root / "late")[0] == DAYS[:2], "handled")
    p = b.learn(late, root / "late", "--on-error", "skip", "--relearn", DAYS[2])
    b.note("... and learns it again with --relearn", p, p.returncode == 0 and same(root / "late", clean), "handled")

    # stops
    rng = random.Random(0)
    longer, clean4 = feed(root / "longer.jsonl", days=4), root / "clean4"
    assert b.learn(longer, clean4).returncode == 0
    for i in range(5):
        proc = subprocess.Popen([monim.script, "learn", "--source", longer, "--workdir", root / "stopped", "--model", model,
                                 "--policy", "fullmem"], env=monim.env(own_api=True), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(1.0, 15.0))
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        took = time.monotonic() - t
        b.note(f"SIGTERM {i + 1} ({took:.1f} s to stop)", None, took < 10 and prefix(root / "stopped", clean4), "handled")
        b.rows[-1]["exit"] = proc.returncode

    # identity
    changed = root / "changed-model"
    shutil.copytree(model, changed)
    first = b.learn(feed(root / "one.jsonl", days=1), root / "weights", "--model", changed)  # the last --model counts
    assert first.returncode == 0, first.stderr[-2000:]
    from safetensors.torch import load_file, save_file

    weights = load_file(changed / "model.safetensors")
    weights[next(iter(weights))] += 0.5
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    p = b.learn(source, root / "weights", "--model", changed)
    b.note("new weights of the same shape at the same path", p, arrays(root / "weights")[0] == DAYS[:1], "refused")
    code = ("from flows.stream import learn_stream; from monim.core.config import RunConfig; "
            f"learn_stream(RunConfig(source={str(longer)!r}, workdir={str(root / 'window')!r}, model={str(model)!r}, "
            "policy='fullmem', stride=256))")
    shutil.copytree(clean, root / "window")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=monim.env(own_api=True),
                       timeout=600)
    said = "field 'window.stride'" in p.stderr
    p = subprocess.CompletedProcess(p.args, p.returncode, "", f"error: {'window.stride refused' if said else p.stderr[-300:]}")
    b.note("another window through the deployment's RunConfig", p, said and same(root / "window", clean), "refused")

    # fsck
    short = feed(root / "short.jsonl", days=3, per_day=2)  # days of two articles: nothing held out
    b.learn(short, root / "short")
    p = b.run("fsck", "--workdir", root / "short")
    b.note("fsck of days with fewer than 3 articles", p, p.returncode == 0, "handled")
    shutil.copytree(clean, root / "copied")
    p = b.run("fsck", "--workdir", root / "copied", "--json")
    ok = p.returncode == 0 and all(x.get("warning") for x in last_json(p).get("problems", [{}]))
    b.note("fsck of a copied work directory (a warning)", p, ok, "handled")
    b.run("fsck", "--workdir", root / "copied", "--repair")
    p = b.run("fsck", "--workdir", root / "copied", "--repair", "--json")
    b.note("fsck --repair twice (nothing logged twice)", p, p.returncode == 0 and same(root / "copied", clean), "handled")
    renamed = root / "renamed.jsonl"
    assert b.learn(feed(root / "before-rename.jsonl"), root / "renamed").returncode == 0
    shutil.copy(feed(root / "four.jsonl", days=4), renamed)  # the same feed under another name, a day longer
    p = b.learn(renamed, root / "renamed")
    from mlflow.tracking import MlflowClient

    names = {m.name for m in MlflowClient(f"sqlite:///{root / 'renamed' / 'mlflow.db'}").search_registered_models()}
    b.note("a renamed source file (the same experiment and registered model)", p, p.returncode == 0 and len(names) == 1,
           "handled")
    shutil.copytree(clean, root / "calibrator")
    mem = root / "calibrator" / "memories" / "fullmem"
    theta = Datastore.read(mem).manifest["thetas"][-1]
    (mem / theta["dir"] / "calibrator.pt").unlink()
    p = b.learn(feed(root / "four.jsonl", days=4), root / "calibrator")
    b.note("a deleted calibrator.pt: learn", p, arrays(root / "calibrator")[0] == DAYS[:3], "refused")
    b.run("fsck", "--workdir", root / "calibrator", "--repair")
    p = b.run("fsck", "--workdir", root / "calibrator")
    b.note("... fsck --repair (trained again from its window)", p, p.returncode == 0, "handled")
    shutil.copytree(clean, root / "shard")
    keys = sorted((root / "shard" / "memories" / "fullmem" / "shards").glob("*/keys.npy"))[0]
    data = bytearray(keys.read_bytes())
    data[-3] ^= 0x10
    keys.write_bytes(bytes(data))
    p = b.learn(feed(root / "four.jsonl", days=4), root / "shard")
    b.note("a flipped byte in a shard: learn", p, arrays(root / "shard")[0] == DAYS[:3], "refused")
    p = b.run("fsck", "--workdir", root / "shard", "--json")
    b.note("... fsck names it (day, entries lost)", p, p.returncode == 1 and "entries lost" in p.stdout,
           "handled")

    # errors
    shutil.copytree(clean, root / "manifest")
    manifest = root / "manifest" / "memories" / "fullmem" / "manifest.json"
    manifest.write_text(manifest.read_text()[:500])
    p = b.run("status", "--workdir", root / "manifest")
    b.note("a truncated manifest", p, "line" in p.stderr, "refused")
    shutil.copytree(clean, root / "mlflow")
    (root / "mlflow" / "mlflow.db").write_bytes(b"not a database" * 100)
    p = b.learn(feed(root / "four.jsonl", days=4), root / "mlflow")
    b.note("a damaged mlflow.db", p, arrays(root / "mlflow")[0] == DAYS[:3], "refused")
    shutil.copytree(clean, root / "prefectdb")
    (root / "prefectdb" / "prefect" / "prefect.db").write_bytes(b"not a database" * 100)
    p = b.learn(feed(root / "four.jsonl", days=4), root / "prefectdb")
    b.note("a damaged Prefect database", p, arrays(root / "prefectdb")[0] == DAYS[:3], "refused")
    (root / "a-file").write_text("")
    p = b.learn(source, root / "a-file")
    b.note("a work directory that is a file", p, True, "refused")
    broken = feed(root / "broken.jsonl")
    broken.write_text(broken.read_text().replace("\n", "\n{broken\n", 4))
    p = b.learn(broken, root / "broken")
    b.note("a bad record mid-stream", p, not (root / "broken" / "memories").exists(), "refused")

    # input
    rows = source.read_text().splitlines()
    dup = root / "dup.jsonl"
    dup.write_text("\n".join(rows + [json.dumps({"id": json.loads(rows[0])["id"], "date": DAYS[2], "text": "Again."})]) + "\n")
    p = b.learn(dup, root / "dup")
    b.note("two articles with one id", p, not (root / "dup" / "memories").exists(), "refused")
    nameless = feed(root / "nameless.jsonl", extra=({"date": DAYS[2], "text": "No id."},))
    p = b.learn(nameless, root / "nameless")
    b.note("a record without an id", p, not (root / "nameless" / "memories").exists(), "refused")
    p = b.learn(nameless, root / "nameless", "--missing-id", "hash")
    b.note("... with --missing-id hash", p, p.returncode == 0, "handled")
    p = b.run("forget", "--workdir", clean, "--doc", "no-such-id")
    b.note("forget of an unknown id", p, True, "refused")
    array = root / "array.json"
    array.write_text(json.dumps([json.loads(r) for r in rows]))
    p = b.learn(array, root / "array")
    b.note("a JSON array file", p, True, "refused")
    bom = root / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + source.read_bytes())
    p = b.learn(bom, root / "bom")
    b.note("a UTF-8 BOM", p, p.returncode == 0 and same(root / "bom", clean), "handled")
    p = b.learn(broken, root / "skipped", "--on-error", "skip", "--json")
    skipped = sum(r["docs_skipped"] for r in last_json(p).get("rows", [])) if p.returncode == 0 else -1
    b.note(f"--on-error skip ({skipped} skipped, counted in the rows)", p, skipped == 4 and same(root / "skipped", clean),
           "handled")
    huge = feed(root / "huge.jsonl", extra=({"id": "huge", "date": DAYS[2], "text": "word " * 300_000},))
    p = b.learn(huge, root / "huge", "--max-article-tokens", "2000", "--json")
    cut = sum(r.get("docs_truncated", 0) for r in last_json(p).get("rows", [])) if p.returncode == 0 else -1
    b.note(f"a 1.5 MB article ({cut} cut to 2,000 tokens, counted)", p, cut == 1, "handled")

    table = Table(title="monim against a daily job's faults (fresh work directories, the `monim` command)")
    for col in ("fault", "exit", "verdict", "message"):
        table.add_column(col, overflow="fold")
    for r in b.rows:
        table.add_row(r["fault"], str(r["exit"]), r["verdict"], r["message"])
    Console(width=200).print(table)
    bad = [r for r in b.rows if r["verdict"] in BAD]
    print(f"{len(b.rows)} faults: {len(b.rows) - len(bad)} refused or handled, {len(bad)} silent, traceback or lost")
    assert not bad, bad
