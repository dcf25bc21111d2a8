"""The Settings page (docs/hooks.py, made at each build) says what the command line says, both ways: every
option of `monim learn` and `monim compare` is on it with the type, default and help `--help` shows, and
every option, default, deployment parameter and Python name on it is one the code has (a doctored page is
caught)."""

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
FLOWS = {"learn": ("flows.stream", "learn_stream"), "compare": ("flows.compare", "compare_policies")}


@pytest.fixture(scope="module")
def page() -> str:
    spec = importlib.util.spec_from_file_location("monim_docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks.settings_page()


def help_entries(verb: str) -> dict[str, str]:
    """`monim VERB --help`'s options as printed: first column (names and type) -> help, lines joined."""
    from cli import app

    out = CliRunner().invoke(app, [verb, "--help"], terminal_width=80).output
    entries: dict[str, list[str]] = {}
    current = None
    for line in out.split("Options:\n", 1)[1].splitlines():
        if m := re.match(r"  (-\S.*?)(?:\s{2,}(.*))?$", line):
            current = m[1]
            entries[current] = [m[2] or ""]
        elif current and line.startswith("   "):
            entries[current].append(line.strip())
    joined = {k: re.sub(r"(\w-) (?=\w)", r"\1", " ".join(v).strip()) for k, v in entries.items()}  # words cut at a hyphen
    return {k: v for k, v in joined.items() if k != "--help"}


def rows(text: str) -> list[dict]:
    """The page's table: option, type, default, help, deployment, Python (back-quotes and escapes removed)."""
    out = []
    for line in text.splitlines():
        if line.startswith("| `-"):
            kept = re.sub(r"`[^`]*`", lambda m: m[0].replace("|", "\0"), line)  # a `|` in a code span ends no cell
            option, default, said, where = [c.strip().replace("\\|", "|").replace("\0", "|")
                                            for c in re.split(r"(?<!\\)\|", kept)[1:-1]]
            (names, kind), (deployment, python) = option.split("<br>"), where.replace("`", "").split("<br>")
            out.append({"option": names.strip("`"), "type": kind.strip("`"), "default": default.strip("`"), "help": said,
                        "deployment": deployment, "python": python})
    return out


def default_of(verb: str, name: str, row: dict):
    """What a run gets when the option is not given: its RunConfig, CalibratorConfig, EvalConfig or flow
    default, read from the code (not from the command line)."""
    from monim.core.catalogue import COMPARED
    from monim.core.config import CalibratorConfig, EvalConfig
    from monim.core.run_config import RunConfig

    where = row["deployment"].split(" ")[0]
    if name == "policies":  # compare_policies: `policies or COMPARED`
        return ",".join(COMPARED)
    if where.startswith("run.calibrator."):
        return getattr(CalibratorConfig(), where.removeprefix("run.calibrator."), None)
    if where.startswith("run."):
        return RunConfig().model_dump().get(where[4:])  # an unknown setting: problems() names it
    if where.startswith("evaluation."):
        return {f.name: f.default for f in dataclasses.fields(EvalConfig)}.get(where[11:])
    module, flow = FLOWS[verb]
    params = inspect.signature(getattr(importlib.import_module(module), flow).fn).parameters
    return params[name].default if name in params else None


def problems(text: str) -> list[str]:
    """What the page says that the code does not: an option, type, default or help `--help` does not show,
    an option of a learning command missing, a default other than the setting's, a deployment parameter
    or Python name the code lacks, a path of the machine that built it."""
    from monim.core.config import CalibratorConfig, EvalConfig
    from monim.core.run_config import RunConfig

    found = [f"a path of the build machine: {p}" for p in (str(REPO), "/home/", "/root/", "site-packages", "<class ")
             if p in text]
    table = rows(text)
    deployments = {d["name"]: d["entrypoint"] for d in
                   yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())["deployments"]}
    for verb in FLOWS:
        helps = help_entries(verb)
        mine = [r for r in table if not r["help"].startswith("(`") or r["help"].startswith(f"(`{verb}` only)")]
        shown = {r["option"] + ("" if r["type"] == "flag" else " " + r["type"]): r for r in mine}
        found += [f"{verb}: {o} is not on the page" for o in helps if o not in shown]
        for first, r in shown.items():
            if first not in helps:
                found.append(f"{verb}: {first}: no such option (`monim {verb} --help`)")
                continue
            said = helps[first]
            default = re.search(r"\[default: (.*?)\]$", said)
            if r["default"] != ("*required*" if said.endswith("[required]") else default[1] if default else "—"):
                found.append(f"{verb}: {first}: default {r['default']!r}, --help says {said[-40:]!r}")
            if re.sub(r" \[A feed's records\]\(.*?\)$", "", r["help"]).removeprefix(f"(`{verb}` only) ") not in said:
                found.append(f"{verb}: {first}: help is not --help's")
            name = r["option"].split(" ")[0].split(",")[0].removeprefix("--").replace("-", "_")
            name = {"json": "as_json"}.get(name, name)
            value = default_of(verb, name, r)
            flags = r["option"].split(" / ")
            expected = ("—" if value is None else flags[0 if value else 1].removeprefix("--") if len(flags) == 2
                        else ",".join(map(str, value)) if isinstance(value, tuple) else str(value))
            if r["default"] not in (expected, "*required*"):
                found.append(f"{verb}: {first}: default {r['default']!r}, a run gets {expected!r}")
    for r in table:
        where, python = r["deployment"].split(" ")[0], r["python"]
        field = re.fullmatch(r"run\.(\w+)(?:\.(\w+))?", where)
        if field and (field[1] not in RunConfig.model_fields or field[2] and (
                field[1] != "calibrator" or field[2] not in {f.name for f in dataclasses.fields(CalibratorConfig)})):
            found.append(f"{r['option']}: no setting {where}")
        if where.startswith("evaluation.") and where[11:] not in {f.name for f in dataclasses.fields(EvalConfig)}:
            found.append(f"{r['option']}: no setting {where}")
        named = re.findall(r"\(([\w, ]+)\)", r["deployment"])
        for d in [] if where == "—" else named[0].split(", ") if named else list(deployments):
            path, flow = deployments.get(d, ":").split(":")
            module = importlib.import_module(path.removesuffix(".py").replace("/", ".")) if path else None
            if module is None or where.split(".")[0] not in inspect.signature(getattr(module, flow).fn).parameters:
                found.append(f"{r['option']}: deployment {d} takes no parameter {where.split('.')[0]}")
        for call, arg in re.findall(r"(\w+)\((?:run, )?(?:calibrator=\{\")?(\w+)", python):
            if call == "RunConfig":
                ok = arg in RunConfig.model_fields or arg in {f.name for f in dataclasses.fields(CalibratorConfig)}
            elif call == "EvalConfig":
                ok = arg in {f.name for f in dataclasses.fields(EvalConfig)}
            else:
                module, flow = next((m, f) for m, f in FLOWS.values() if f == call)
                ok = arg in inspect.signature(getattr(importlib.import_module(module), flow).fn).parameters
            if not ok:
                found.append(f"{r['option']}: {call} takes no {arg}")
    return found


def test_the_settings_page_is_the_command_lines_both_ways(page):
    assert problems(page) == []
    options = {r["option"] for r in rows(page)}
    assert {"--calibration", "--skip", "--source", "--date-field", "--policies", "--relearn"} <= options
    assert not {"--followed-memrate", "--calibrator"} & options


@pytest.mark.parametrize("doctor, caught", [
    (lambda p: p + "| `--followed-memrate`<br>`<float>` | — | Set by a comparison. | `run.followed_memrate`<br>"
     "`RunConfig(followed_memrate=…)` |\n", "--followed-memrate <float>: no such option"),
    (lambda p: p + "| `--calibrator`<br>`<class 'monim.core.config.CalibratorConfig'>` | `CalibratorConfig(groups=…)` | "
     "How. | `run.calibrator`<br>`RunConfig(calibrator=…)` |\n", "a path of the build machine: <class "),
    (lambda p: p.replace("| *required* |", f"| `{REPO}/monim/data/reuters.jsonl.gz` |", 1), "a path of the build machine"),
    (lambda p: p.replace("| `--delta`<br>`<float>` | `-1.5` |", "| `--delta`<br>`<float>` | `-1.0` |"),
     "--delta <float>: default '-1.0'"),
    (lambda p: re.sub(r"\| `--skip`<br>.*\n", "", p), "--skip <float> is not on the page"),
    (lambda p: p.replace("`run.calibrator.skip_threshold`", "`run.calibrator.skip`"), "no setting run.calibrator.skip"),
    (lambda p: p.replace("`RunConfig(max_docs=…)`", "`RunConfig(max_doc=…)`"), "RunConfig takes no max_doc"),
    (lambda p: p.replace("`start` (backfill)", "`start` (daily)"), "deployment daily takes no parameter start"),
])
def test_a_doctored_page_is_caught(page, doctor, caught):
    said = problems(doctor(page))
    assert any(caught in s for s in said), said
