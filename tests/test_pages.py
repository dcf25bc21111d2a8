"""Every command the README and the site show runs as written, and prints what the page shows.

A page's ```bash blocks, and its ```python blocks (each as `python - <<'PYTHON' ... PYTHON`), run in
order as one `bash -e -o pipefail` session (a `cd` or a variable carries over, the first failing command
stops it) in a fresh folder standing for the reader's clone after `make run`: its `.venv` is the test's
venv (`. .venv/bin/activate` works), `monim` and `python` are on the PATH, and commands share the test
session's Prefect server (a reader's first command starts one of its own, 10-20 s each). `make run` is
the install (this venv) and the demo, so a page's `make run` runs `monim run`. A block the reader is not
meant to paste as is says why just above it, `<!-- not run: why, in three words or more -->` (`make
test`: this suite). The results pages' blocks made their measurements (minutes to hours on the full data)
and are not run, but each script they name exists.

Output: each block's stdout and stderr (with those of the servers it starts) go to a file of their own.
A ```text block right after a block is what the reader should see: each of its words that holds no digit
(numbers, dates, ids and seconds vary by machine) must be in what the block printed, and it must show at
least three such words, so a trimmed output passes and an invented or stale one fails.

Pages need the real LM (SmolLM2-135M) where they learn, evaluate, generate or serve: README.md
(`make run`: the 4-day demo, 4 min on 2 cores, then the tour), docs/quickstart.md, docs/tutorial.md and
the guides that learn (compare, serve, forget, schedule, dask, own-model-and-feed). They read the bundled
stream (`monim demo-feed`) at the smallest sizes (`--max-docs 2`, two days) and take 1-3 minutes each,
the README about 8. A page that serves uses a port no other page uses (README 5001, serve guide 5002
and 5003, tutorial 5004, troubleshooting 5091): the two files of pages run at once, on two workers.
This file runs the README and the pages outside docs/guides/; tests/test_pages_guides.py the guides.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]+?) -->\s*\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```"
                   r"(?:\s*```text\n(?P<shown>.*?)```)?", re.S)
# A reader's `make run` in the folder the page runs in: the install is the test's venv, the demo is `monim run`.
MAKE = 'make() { if [ "$*" = run ]; then monim run; else echo "make $*: not in a page" >&2; return 2; fi; }\n'


def blocks(text: str) -> list[tuple[str, str | None, str | None]]:
    """A page's blocks of commands: (the code as bash runs it, why it is not run or None, the output shown or None)."""
    return [(m["code"] if m["lang"] == "bash" else f"python - <<'PYTHON'\n{m['code']}PYTHON\n", m["why"], m["shown"])
            for m in BLOCK.finditer(text)]


def name(page: Path) -> str:
    return str(page.relative_to(REPO))


def runnable(page: Path) -> bool:
    return not name(page).startswith("docs/results/") and any(why is None for _, why, _ in blocks(page.read_text()))


def script(text: str, out: Path) -> str:
    """The page's blocks to run, as one script that stops at the first failing command, each block's output
    (the processes it starts included) going to its own file in `out` (1, 2, ...)."""
    run = [code for code, why, _ in blocks(text) if why is None]
    return "set -euo pipefail\n" + MAKE + "".join(f'exec > "{out}/{i}" 2>&1\n{code}' for i, code in enumerate(run, 1))


def words(shown: str) -> set[str]:
    """The words of an output a page shows (JSON's keys and values too), leaving out what varies by machine:
    anything holding a digit (numbers, dates, times, ids) or a slash (paths)."""
    return {w for w in (w.strip(".()'`|") for w in re.split(r"[\s,:;{}\[\]\"]+", shown))
            if not re.search(r"[\d/]", w) and re.search(r"[^\W\d_]", w)}


def missing(text: str, out: Path) -> list[str]:
    """What the page's ```text blocks show that its commands did not print: one line per block, with the words."""
    said = []
    for i, (code, why, shown) in enumerate([b for b in blocks(text) if b[1] is None], 1):
        if shown is None:
            continue
        printed = (out / str(i)).read_text()
        if len(expected := words(shown)) < 3:
            said.append(f"block {i} shows fewer than 3 words to check: {shown[:200]!r}")
        elif lost := sorted(w for w in expected if w not in printed):
            said.append(f"block {i} (`{code.strip().splitlines()[0]}`) did not print {lost}:\n{printed[-2000:]}")
    return said


def run_page(text: str, folder: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    """Run a page's commands in `folder` as a reader pastes them: (the bash process, the folder of block outputs)."""
    out = folder.parent / f"{folder.name}-out"
    out.mkdir()
    proc = subprocess.run(["bash", "-c", script(text, out)], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=1800)
    return proc, out


def last_output(out: Path) -> str:
    files = sorted(out.iterdir(), key=lambda p: int(p.name))
    return f"block {files[-1].name}:\n{files[-1].read_text()[-4000:]}" if files else ""


def check(page: Path, monim, tmp_path: Path) -> None:
    """Run a page's commands as a reader after `make run` would, and compare what they print with what it shows."""
    env = monim.env() | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    (folder := tmp_path / "reader").mkdir()
    (folder / ".venv").symlink_to(sys.prefix)  # `. .venv/bin/activate`, as in the reader's clone
    proc, out = run_page(text := page.read_text(), folder, env)
    assert proc.returncode == 0, f"{name(page)}: exit {proc.returncode}\n{last_output(out)}\n{proc.stderr[-3000:]}"
    assert not (said := missing(text, out)), f"{name(page)}: " + "\n".join(said)


GUIDES = [p for p in PAGES if runnable(p) and name(p).startswith("docs/guides/")]  # tests/test_pages_guides.py


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p) and p not in GUIDES], ids=name)
def test_every_command_a_page_shows_runs_as_written_and_prints_what_it_shows(page, monim, tmp_path):
    check(page, monim, tmp_path)


def test_a_page_that_shows_other_output_than_its_commands_print_fails(tmp_path):
    """The check itself, on a page written here: a word the command did not print, or too few words, fails it;
    the blocks share one shell, and the first failing command stops the page."""
    page = ("```bash\necho 'policy   days memrate'; echo 'fullmem 4 100.0%'\nmkdir sub; cd sub; kept=yes\n```\n\n"
            "```text\npolicy  days memrate\nfullmem  2  99.1%\n```\n"
            "```python\nprint('Oil prices rose, traders said')\n```\n```text\nOil prices fell, traders said\n```\n"
            "<!-- not run: the reader's own choice -->\n```bash\nfalse\n```\n```text\nnever checked here\n```\n"
            "```bash\necho \"in $(basename $PWD), kept=$kept\"\n```\n```text\n42\n```\n")
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    (folder := tmp_path / "reader").mkdir()
    proc, out = run_page(page, folder, env)
    assert proc.returncode == 0, proc.stderr
    assert words("fullmem  2  99.1%  ppl_lm, 1987-03-02 (MLflow:) /tmp/w/mlflow.db") == {"fullmem", "ppl_lm", "MLflow"}
    assert words('{"status":"ok","problem":null,"tokens":26}') == {"status", "ok", "problem", "null", "tokens"}
    said = missing(page, out)
    assert len(said) == 2 and "['fell']" in said[0] and "fewer than 3 words" in said[1], said
    assert (out / "3").read_text() == "in sub, kept=yes\n"
    stopped = subprocess.run(["bash", "-c", script("```bash\nfalse\necho after\n```\n", out)], cwd=folder)
    assert stopped.returncode == 1 and (out / "1").read_text() == ""


def test_a_block_not_run_says_why_and_the_results_name_real_scripts():
    for page in PAGES:
        for code, why, _ in blocks(page.read_text()):
            assert why is None or len(why.split()) >= 3, f"{name(page)}: say why a block is not run"
            for script_path in re.findall(r"python (\S+\.py)", code):
                assert (REPO / script_path).is_file(), f"{name(page)}: no script {script_path}"
