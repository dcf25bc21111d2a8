"""MkDocs hooks: the reference pages made from the code at each build (the CLI from the Typer app,
the HTTP API from FastAPI's OpenAPI schema, the settings from the learning commands' options), and the README as
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

    from cli import app

    command = typer.main.get_command(app)
    docs = get_docs_for_click(obj=command, ctx=click.Context(command, info_name="monim"), name="monim",
                              title="Command line")
    return docs + ("\n\nEvery option's default and meaning is also in `monim <command> --help`. What `--source` reads "
                   "(a feed's records, a folder, a `datasets` dataset) is in [Bring your own model and feed]"
                   "(../guides/own-model-and-feed.md#a-feeds-records); the learning commands' options, each beside its "
                   "deployment parameter and Python name, in [Settings](settings.md).\n")


def _shown(value) -> str:
    """JSON as a page shows it: indented, a list of numbers on one line."""
    text = json.dumps(value, indent=1, ensure_ascii=False)
    return re.sub(r"\[([^\[\]{}\"]+)\]", lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text)


def http_page(spec_path: Path) -> str:
    """The served model's routes, limits, errors, bodies and real examples, from the FastAPI app's OpenAPI
    schema and the models it is made of (servers.schema)."""
    from servers import schema
    from servers.examples import EXAMPLES
    from servers.model import openapi

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


LEARNING = {"learn": "flows.stream:learn_stream", "compare": "flows.compare:compare_policies"}  # command -> its flow


def deployed(parameter: str) -> list[str]:
    """The deployments of deployments/prefect.yaml whose flow takes this parameter."""
    import importlib
    import inspect

    import yaml

    out = []
    for d in yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())["deployments"]:
        path, name = d["entrypoint"].split(":")
        module = path.removesuffix(".py").replace("/", ".")
        if parameter in inspect.signature(getattr(importlib.import_module(module), name).fn).parameters:
            out.append(d["name"])
    return out


def option_rows() -> list[dict]:
    """Each option of the learning commands as `--help` shows it (names, type, default, help), with the
    setting it is in a deployment and in Python, and the commands that take it."""
    import dataclasses
    import importlib
    import inspect

    import click
    import typer

    from cli import app
    from cli.options import CALIBRATOR
    from monim.core.config import EvalConfig
    from monim.core.run_config import RunConfig

    group = typer.main.get_command(app)
    rows: dict[str, dict] = {}
    for verb, flow in LEARNING.items():
        command = group.commands[verb]
        module, function = flow.split(":")
        takes = inspect.signature(getattr(importlib.import_module(module), function).fn).parameters
        for p in command.params:
            if p.param_type_name != "option":
                continue
            if p.name in rows:
                rows[p.name]["commands"].append(verb)
                if p.name in takes and rows[p.name]["python"].startswith(tuple(f.split(":")[1] for f in LEARNING.values())):
                    rows[p.name]["python"] += f" or {function}(run, {p.name}=…)"
                continue
            shown, text = p.get_help_record(click.Context(command, info_name=verb))
            names = ", ".join(p.opts) + (" / " + ", ".join(p.secondary_opts) if p.secondary_opts else "")
            extra = re.fullmatch(r"(.*?)(?:  \[(.*)\])?", text, re.S)
            said = dict(part.split(": ", 1) if ": " in part else (part, "") for part in (extra[2] or "").split("; ") if part)
            if p.name in RunConfig.model_fields:
                where, python = f"run.{p.name}", f"RunConfig({p.name}=…)"
            elif p.name in CALIBRATOR:
                field = CALIBRATOR[p.name][0]
                where, python = f"run.calibrator.{field}", f'RunConfig(calibrator={{"{field}": …}})'
            elif p.name in {f.name for f in dataclasses.fields(EvalConfig)}:
                where, python = f"evaluation.{p.name}", f"EvalConfig({p.name}=…)"
            elif p.name in takes:
                where, python = p.name if deployed(p.name) else "", f"{function}(run, {p.name}=…)"
            else:
                where, python = "", ""  # the command's own (its output)
            rows[p.name] = {"names": names, "type": shown[len(names):].strip() or "flag",
                            "default": "required" if "required" in said else said.get("default", ""),
                            "help": extra[1], "deployment": where, "deployments": deployed(where.split(".")[0]) if where else [],
                            "python": python, "commands": [verb]}
    return list(rows.values())


SECTIONS = {"run.": "The run: `RunConfig`", "evaluation.": "The evaluation suite: `EvalConfig`",
            "": "The flow's parameters and the command's own"}  # the page's tables, by where a setting lives


def settings_page() -> str:
    """The learning commands' options (`monim learn --help`), each beside its deployment parameter and Python name,
    in one table per kind of setting."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    from cli.options import FEED

    feed = {f"run.{name}" for name in ("source", "on_error", *FEED)}  # the rows that link to a feed's records
    tables: dict[str, list[str]] = {prefix: [] for prefix in SECTIONS}
    for r in option_rows():
        only = "" if len(r["commands"]) == len(LEARNING) else f"(`{r['commands'][0]}` only) "
        default = "*required*" if r["default"] == "required" else f"`{r['default']}`" if r["default"] else "—"
        link = " [A feed's records](../guides/own-model-and-feed.md#a-feeds-records)" if r["deployment"] in feed else ""
        every = len(r["deployments"]) == len(deployed("run"))
        where = (f"`{r['deployment']}`" + ("" if every else f" ({', '.join(r['deployments'])})") if r["deployment"]
                 else "— (not deployed)" if r["python"] else "—")
        python = f"`{r['python']}`" if r["python"] else "— (this command's output)"
        prefix = next(p for p in SECTIONS if r["deployment"].startswith(p))
        tables[prefix].append(f"| `{r['names']}`<br>`{r['type']}` | {cell(default)} | {only}{cell(r['help'])}{link} | "
                              f"{where}<br>{python} |")
    body = "".join(f"## {SECTIONS[p]}\n\n| option, type | default | what it sets | deployment, Python |\n|---|---|---|---|\n"
                   + "\n".join(lines) + "\n\n" for p, lines in tables.items())
    return ("# Settings\n\nThe options of the learning commands, `monim learn` and `monim compare`, as `monim learn "
            "--help` shows them (read from the command line at each build), each with the same setting in a "
            "deployment and in Python. A run's settings are the fields of `monim.core.run_config.RunConfig`, one name "
            "each: `--max-docs 16` on the command line is `parameters: {run: {max_docs: 16}}` in "
            "`deployments/prefect.yaml` (`run.max_docs` below) and `RunConfig(max_docs=16)` in Python; the "
            "evaluation suite's are `monim.core.config.EvalConfig`'s (`parameters: {evaluation: {period: "
            "month}}`); a few are the flow's own parameters (`start`, `end`: the `backfill` deployment's). "
            "An option not given takes the default shown, the same in a deployment and in Python, but for `source`: the "
            "command line needs it, a deployment reads it from `$MONIM_SOURCE` when deployed, and Python's RunConfig "
            "defaults to the bundled Reuters stream. Which setting wins where several are given "
            "(the command line, a deployment, the environment, a memory's record) is in [Configuration]"
            "(configuration.md); what a feed's records hold (`--source`, `--date-field`, ...) in [Bring your own "
            "model and feed](../guides/own-model-and-feed.md).\n\n" + body)


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
