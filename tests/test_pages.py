"""Every command the README and the site show runs as written: a page's ```bash blocks (and its ```python
blocks, each as `python - <<EOF`), in order, as one `bash -e` session in a fresh folder,
the reader's clone after `make run` (its `.venv` is the test's venv), with `monim` and `python` on the PATH and the test session's Prefect server (a reader's first command starts
one of its own: 10-20 s each). What a page shows a command printing is what the reader gets: a ```text block
right after a block holds words (not numbers: they vary by machine) that the block really printed, each of them.
A block the reader is not meant to paste is marked `<!-- not run: why -->` just above it; the results pages'
blocks made their measurements (minutes to hours on the full data) and are not run, but each script they
name exists. `make run` is the install (the test's own venv) and `monim run`, so a page's `make run` runs
`monim run`; `make test` is this suite and is not run.

Pages that learn read the bundled stream (`monim demo-feed`) at the smallest sizes their options allow
(--max-docs 2, two days) with the real LM (SmolLM2-135M), as all pages with a `monim learn`, `compare`,
`generate`, `eval`, `serve-model` or `run` do: README.md (`monim run`, the tour), docs/quickstart.md
(`monim run`), docs/tutorial.md, docs/guides/compare.md, serve.md, forget.md, schedule.md, dask.md,
own-model-and-feed.md. On 2 cores README.md and the tutorial take about N minutes each, a guide 1-2.
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
    """The words of an output a page shows, numbers (and anything holding a digit: dates, times, ids) left out."""
    return {w for w in (w.strip(".,:;()[]{}'\"`|") for w in shown.split() if not re.search(r"\d", w))
            if re.search(r"[^\W\d_]", w)}


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
                          timeout=900)
    return proc, out


def last_output(out: Path) -> str:
    files = sorted(out.iterdir(), key=lambda p: int(p.name))
    return f"block {files[-1].name}:\n{files[-1].read_text()[-4000:]}" if files else ""


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=name)
def test_every_command_a_page_shows_runs_as_written_and_prints_what_it_shows(page, monim, tmp_path):
    env = monim.env() | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    (folder := tmp_path / "reader").mkdir()
    (folder / ".venv").symlink_to(sys.prefix)  # `. .venv/bin/activate`, as a reader after `make run`
    proc, out = run_page(text := page.read_text(), folder, env)
    assert proc.returncode == 0, f"{name(page)}: exit {proc.returncode}\n{last_output(out)}\n{proc.stderr[-3000:]}"
    assert not (said := missing(text, out)), f"{name(page)}: " + "\n".join(said)


def test_a_page_that_shows_other_output_than_its_commands_print_fails(tmp_path):
    """The check itself, on a page written here: a word the command did not print, or too few words, fails it."""
    page = ("```bash\necho 'policy   days memrate'; echo 'fullmem 4 100.0%'\n```\n\n"
            "```text\npolicy  days memrate\nfullmem  2  99.1%\n```\n"
            "```python\nprint('Oil prices rose, traders said')\n```\n```text\nOil prices fell, traders said\n```\n"
            "<!-- not run: the reader's own choice -->\n```bash\nfalse\n```\n```text\nnever checked here\n```\n"
            "```bash\ncd sub 2>/dev/null || mkdir sub && cd sub && echo in $(basename $PWD) now\n```\n```text\n42\n```\n")
    (folder := tmp_path / "reader").mkdir()
    proc, out = run_page(page, folder, os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert words("fullmem  2  99.1%  ppl_lm, 1987-03-02 (MLflow:)") == {"fullmem", "ppl_lm", "MLflow"}
    said = missing(page, out)
    assert len(said) == 2 and "['fell']" in said[0] and "fewer than 3 words" in said[1], said
    assert (out / "3").read_text() == "in sub now\n"  # the blocks share one shell: state carries over
    assert subprocess.run(["bash", "-c", script("```bash\nfalse\necho after\n```\n", out)], cwd=folder).returncode == 1


def test_a_block_not_run_says_why_and_the_results_name_real_scripts():
    for page in PAGES:
        for code, why, _ in blocks(page.read_text()):
            assert why is None or len(why.split()) >= 3, f"{name(page)}: say why a block is not run"
            for script_path in re.findall(r"python (\S+\.py)", code):
                assert (REPO / script_path).is_file(), f"{name(page)}: no script {script_path}"
