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


def _shown(value) -> str:
    """JSON as a page shows it: indented, a list of numbers on one line."""
    text = json.dumps(value, indent=1, ensure_ascii=False)
    return re.sub(r"\[([^\[\]{}\"]+)\]", lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text)


def http_page(spec_path: Path) -> str:
    """The served model's routes, limits, errors, bodies and real examples, from the FastAPI app's OpenAPI
    schema and the models it is made of (flows.servers.schema)."""
    from flows.servers import schema
    from flows.servers.examples import EXAMPLES
    from flows.servers.model import openapi

    spec = openapi()
    spec_path.write_text(json.dumps(spec, indent=1))
    routes = "\n".join(f"| `{method.upper()} {path}` | {op['summary']} |" for path, ops in spec["paths"].items()
                       for method, op in ops.items())
    limits = "\n".join(f"| `{name}` | {f.default:,} | {f.description} |" for name, f in schema.Limits.model_fields.items())
    errors = "\n".join(f"| {status} | `{code}` | {when} |" for code, (status, when) in schema.ERRORS.items())
    examples = "\n".join(f"### {e.summary}\n\n`{e.method.upper()} {e.path}`"
                         + (f" with\n\n```json\n{_shown(e.request)}\n```\n\n" if e.request else ": ")
                         + f"answered {e.status}:\n\n```json\n{_shown(e.answer)}\n```\n" for e in EXAMPLES.values())
    return f"""# HTTP API

`monim serve-model` answers on one process; [the serve guide](../guides/serve.md) starts one and calls each
route. This page is read from the app at each build (a running server gives the same schema at
`GET /openapi.json`); every example below is a real request and the answer the server gave it.

| route | what it answers |
|---|---|
{routes}

A request to `POST /invocations` is MLflow's scoring format in any of its four forms (`dataframe_records`,
`dataframe_split`, `inputs`, `instances`: [the serve guide](../guides/serve.md#request-formats) shows each);
a row is a `text` (answered with a `Score`) or a `prompt` (a `Continuation`, with the article retrieved
before it where the row says `"retrieve": true`); the answer is `{{"predictions": [...]}}`, one a row, in order.

## Limits

Each request is checked against them before any work; `/health` shows a server's (`monim serve-model`'s
options set the first four).

| limit | default | what it bounds |
|---|---|---|
{limits}

## Errors

Every error, whatever its status, is one JSON object, `{{"error_code": ..., "message": ...}}`, the message
naming the field and the limit; never a trace.

| status | `error_code` | when |
|---|---|---|
{errors}

## Examples

Real requests to the server [the serve guide](../guides/serve.md) starts, and its answers (the guide's
memory: two days of the bundled stream, then a third, with the default LM).

{examples}
## Routes and bodies

[OAD({spec_path})]
"""


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
