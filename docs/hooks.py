"""MkDocs hooks: the reference pages made from the code at each build (the CLI from the Typer app,
the HTTP API from FastAPI's OpenAPI schema, every setting from RunConfig's fields), and the README as
the front page; nothing generated is committed."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]


def cli_page() -> str:
    """Every `monim` command with its options, from the Typer app (Typer's own markdown)."""
    import click
    import typer
    from typer.cli import get_docs_for_click

    from flows.cli import app

    command = typer.main.get_command(app)
    docs = get_docs_for_click(obj=command, ctx=click.Context(command, info_name="monim"), name="monim",
                              title="Command line")
    return docs + "\n\nEvery option's default and meaning is also in `monim <command> --help`.\n"


def http_page(spec_path: Path) -> str:
    """The served model's routes and bodies, from the FastAPI app's OpenAPI schema."""
    from flows.servers.model import openapi

    spec_path.write_text(json.dumps(openapi(), indent=1))
    return ("# HTTP API\n\n`monim serve-model` answers on one process (see [Serve and follow the champion]"
            "(../guides/serve.md)). The schema below is FastAPI's, read from the app at each build; a running "
            "server also gives it at `GET /openapi.json`. A request is MLflow's scoring format in any of its four "
            "forms (`dataframe_records`, `dataframe_split`, `inputs`, `instances`); its limits (`Limits`: bytes, "
            "nesting depth, rows, characters, tokens, seconds) and errors (400, 413, 503, 500, each the `Error` "
            "object) are below and, with an example of each form, in [the serve guide](../guides/serve.md#request-"
            "formats-limits-and-errors).\n\n" + f"[OAD({spec_path})]\n")


def settings_page() -> str:
    """Every setting of a run: RunConfig's fields, each one name in Python, the CLI and the deployment."""
    from monim.core.config import RunConfig

    rows = []
    for name, f in RunConfig.model_fields.items():
        kind = re.sub(r"typing\.|<class '(\w+)'>", r"\1", str(f.annotation))
        default = f.default if f.default_factory is None else f.default_factory()
        rows.append(f"| `{name}` | `--{name.replace('_', '-')}` | `{kind}` | `{default!r}` | "
                    f"{(f.description or '').replace('|', '/')} |")
    return ("# Settings\n\nA run's settings are the fields of `monim.core.config.RunConfig`: the same name in "
            "Python (`RunConfig(max_docs=16)`), on the command line (`--max-docs 16`) and in the deployment "
            "(`parameters: {run: {max_docs: 16}}` in `deployments/prefect.yaml`). Read from the code at each "
            "build.\n\n| field | option | type | default | what it sets |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def on_files(files: Files, config) -> Files:
    built = Path(tempfile.mkdtemp(prefix="monim-docs-"))
    readme = (REPO / "README.md").read_text()
    pages = {"index.md": re.sub(r"\]\(docs/", "](", readme), "reference/cli.md": cli_page(),
             "reference/http.md": http_page(built / "openapi.json"), "reference/settings.md": settings_page()}
    for path, content in pages.items():
        source = built / path  # on disk: the OpenAPI plugin reads a page's folder
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(content)
        files.append(File(path, str(built), config.site_dir, config.use_directory_urls))
    return files
