"""The benches as data: each bench's module, what it needs and its minutes on 2 cores (`monim bench --list`);
its description is its module docstring's first line, read without importing it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
NEEDS = ("shared data", "GPU", "network")


class Bench(NamedTuple):
    module: str  # benchmarks/<module>.py
    needs: tuple[str, ...]  # of NEEDS; empty: runs anywhere
    minutes: float  # wall minutes of its default options on 2 cores (from the runs on its results page, else an estimate)


BENCHES: dict[str, Bench] = {
    "calibration": Bench("calibration", ("shared data",), 40),
    "claims": Bench("claims", (), 0.5),
    "cluster-scale": Bench("cluster_scale", (), 25),
    "cli": Bench("cli", (), 3),
    "day": Bench("day", (), 15),
    "decision": Bench("decision", ("shared data",), 30),
    "full-volume": Bench("full_volume", ("shared data",), 240),
    "gpu": Bench("gpu", ("GPU",), 8),
    "gpu-diagnosis": Bench("gpu_diagnosis", ("GPU",), 1),
    "index-codecs": Bench("index_codecs", ("shared data",), 30),
    "index-scale": Bench("index_scale", (), 20),
    "learner-lr": Bench("learner_lr", ("shared data",), 30),
    "lm-throughput": Bench("lm_throughput", ("shared data",), 5),
    "pipeline": Bench("pipeline", ("shared data",), 15),
    "policies": Bench("policies", ("shared data",), 40),
    "ralm-side-by-side": Bench("ralm_side_by_side", ("shared data",), 120),
    "redundancy": Bench("redundancy", ("shared data",), 30),
    "serve-limits": Bench("serve_limits", (), 5),
    "serve-load": Bench("serve_load", (), 10),
    "serve-swap": Bench("serve_swap", (), 5),
    "verify-cost": Bench("verify_cost", (), 2),
}


def description(name: str) -> str:
    """The first line of a bench's module docstring."""
    path = HERE / f"{BENCHES[name].module}.py"
    if not path.exists():
        return f"(no {path.name})"
    return (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]
