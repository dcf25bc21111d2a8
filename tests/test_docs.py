"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a missing page or a
reference to a renamed object fails it) with its references read from the code, the README fits a
screen or two, every `monim` command the pages write names real commands and options, and the HTTP
reference describes the fields the server accepts."""

import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import click
import pytest
import typer

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(out)], cwd=REPO,
                          env=os.environ | {"NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out


def test_the_references_are_read_from_the_code(site):
    from cli import app
    from monim.core.run_config import RunConfig

    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert all(f"monim {name}" in cli for name in typer.main.get_command(app).commands)
    http = (site / "reference" / "http" / "index.html").read_text()
    assert all(word in http for word in ("/invocations", "/health", "/ping", "dataframe_records", "dataframe_split",
                                         "instances", "max_new_tokens", "max_body_bytes", "max_depth", "413",
                                         "REQUEST_ENTITY_TOO_LARGE", "/version", "Ashton-Tate said it intends to"))
    assert "not accurate" not in http  # every example shown is a real one (servers.examples), none generated
    settings = (site / "reference" / "settings" / "index.html").read_text()  # its rows: tests/test_settings_page.py
    learn = typer.main.get_command(app).commands["learn"]
    assert all(flag in settings for p in learn.params for flag in p.opts if flag != "--help")
    assert all(f"run.{name}" in settings for name in RunConfig.model_fields if name not in ("followed_memrate", "calibrator"))
    assert "--followed-memrate" not in settings and str(REPO) not in settings
    python = (site / "reference" / "python" / "index.html").read_text()
    assert all(name in python for name in ("amt_threshold", "memorize_day", "make_run", "ThetaRule"))
    assert (site / "index.html").exists() and "make run" in (site / "index.html").read_text()


def test_the_readme_is_a_screen_or_two():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def commands(text: str) -> list[str]:
    """The `monim ...` lines of a page's bash blocks, continuation lines joined, each up to a redirection or the
    next command (`> out.json`, `| tail`, `|| echo`; synopses with [...] left out)."""
    out = []
    for block in re.findall(r"```(?:bash|console)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r" #| \|\|?|\s\d?>>?|&&|;", line)[0].strip().removesuffix("&").strip()  # up to a pipe, redirect or next command
            if line.startswith("monim ") and not re.search(r"\[|\.\.\.|…|<", line):
                out.append(line)
    return out


def test_every_monim_command_written_names_real_commands_and_options():
    from cli import app

    group = typer.main.get_command(app)
    written = [(page.name, line) for page in PAGES for line in commands(page.read_text())]
    assert len(written) >= 10
    for page, line in written:
        args = shlex.split(line)[1:]
        command = group.commands.get(args[0])
        assert command is not None, f"{page}: `{line}`: no command {args[0]!r}"
        try:
            command.make_context(args[0], args[1:])
        except (click.NoSuchOption, click.BadOptionUsage, click.UsageError) as e:
            if not isinstance(e, (click.BadParameter, click.MissingParameter)):
                raise AssertionError(f"{page}: `{line}`: {e}") from None


def test_the_http_reference_describes_the_fields_the_server_accepts():
    from monim.serving.generation import GenerateConfig, Generation
    from monim.serving.request import FORMATS, ROW_FIELDS, Limits
    from monim.serving.sentences import Cited
    from servers import schema

    assert set(schema.Row.model_fields) == set(schema.Columns.model_fields) == {*ROW_FIELDS, "retrieve"}
    assert set(schema.Invocation.model_fields) == {*FORMATS, "params"}
    assert schema.Limits().model_dump() == asdict(Limits())
    assert set(schema.Params.model_fields) == {f.name for f in fields(GenerateConfig)} - {"keep_distributions", "retrieve"}
    assert {f: schema.Params.model_fields[f].default for f in schema.Params.model_fields} == {
        f.name: f.default for f in fields(GenerateConfig) if f.name in schema.Params.model_fields}
    # the answers: a prompt's Generation and its sentences' sources, field for field (tests/test_http_reference.py
    # checks every answer the server gives against these models)
    assert list(schema.Continuation.model_fields) == [f.name for f in fields(Generation) if f.name != "logprobs"]
    assert list(schema.Cited.model_fields) == [f.name for f in fields(Cited)]
