"""Every command the README and the site show runs as written: a page's ```bash blocks, in order, as one
`bash -e` script in a fresh, empty folder (the reader's), with `monim` on the PATH and the test session's
Prefect server (a reader's first command starts one of its own: 10-20 s each). A block the reader is not
meant to paste is marked `<!-- not run: why -->` just above it; the results pages' blocks made their
measurements (minutes to hours on the full data) and are not run, but each script they name exists.
A page that learns reads the bundled stream (`monim demo-feed`) at the smallest sizes its options allow.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>[^>]+?) -->\s*\n)?```bash\n(?P<code>.*?)```", re.S)


def blocks(text: str) -> list[tuple[str, str | None]]:
    """A page's bash blocks: (code, why it is not run, or None)."""
    return [(m["code"], m["why"]) for m in BLOCK.finditer(text)]


def name(page: Path) -> str:
    return str(page.relative_to(REPO))


def runnable(page: Path) -> bool:
    return not name(page).startswith("docs/results/") and any(why is None for _, why in blocks(page.read_text()))


def script(page: Path) -> str:
    """The page's blocks to run, as one script that stops at the first failing command."""
    return "set -euo pipefail\n" + "\n".join(code for code, why in blocks(page.read_text()) if why is None)


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=name)
def test_every_command_a_page_shows_runs_as_written(page, monim, tmp_path):
    env = monim.env() | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script(page)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{name(page)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_a_block_not_run_says_why_and_the_results_name_real_scripts():
    for page in PAGES:
        for code, why in blocks(page.read_text()):
            assert why is None or len(why.split()) >= 3, f"{name(page)}: say why a block is not run"
            for script_path in re.findall(r"python (\S+\.py)", code):
                assert (REPO / script_path).is_file(), f"{name(page)}: no script {script_path}"
