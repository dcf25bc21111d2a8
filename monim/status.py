"""A work directory's status: each memory (its days, entries, MemRate, bytes) and each parametric
learner's weights, read from disk without the LM."""

from __future__ import annotations

from pathlib import Path

from monim.storage.workdirs import memories, memory_status


def weights_status(root: Path) -> dict:
    """A parametric learner's days, tokens trained, optimizer steps and bytes on disk."""
    from monim.learning.parametric import Weights  # torch: only where a work directory has a learner

    weights = Weights(root)
    metas = [weights.meta(d) for d in weights.days()]
    return {"days": len(metas), "last_day": metas[-1]["date"] if metas else None, "bytes": weights.bytes_on_disk(),
            "tokens_trained": sum(m["tokens_trained"] for m in metas), "steps": metas[-1]["step"] if metas else 0}


def status(workdir: str | Path) -> dict:
    """Every memory and every learner's weights of a work directory."""
    return {"memories": {root.name: memory_status(root) for root in memories(workdir)},
            "weights": {p.name: weights_status(p) for p in sorted((Path(workdir) / "weights").glob("*")) if p.is_dir()}}
