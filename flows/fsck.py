"""fsck of a work directory: every memory against its manifest, run records against memories, and
MLflow's steps against run records; with `repair`, what is derived is rebuilt. No Prefect run:
a check is quick and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

from monim.fsck import check_memory, check_records
from tasks.tracking import check_steps, tracking_uri as resolve_tracking_uri


def check_workdir(workdir: str, tracking_uri: str | None = None, repair: bool = False) -> list[dict]:
    """Every problem found (each with what repair does, and whether it was done)."""
    problems = [p.as_dict() for root in sorted((Path(workdir) / "memories").glob("*"))
                if (root / "manifest.json").exists() for p in check_memory(root, repair)]
    problems += [p.as_dict() for p in check_records(workdir, repair)]
    return problems + check_steps(resolve_tracking_uri(workdir, tracking_uri), workdir, repair)
