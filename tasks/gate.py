"""The champion gate: Θ as of a learned day registered as a new version, and `champion` moved to it
where its validation PPL is not worse than the champion's on the same articles."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from monim.core.run_config import RunConfig
from monim.data.day import Day
from monim.evaluation.evaluate import evaluate_many
from monim.lm.features import Features
from monim.storage import workdirs
from monim.theta.memory import Memory
from tasks.cluster import stage
from tasks.logs import logger
from tracking.champion import settle
from tracking.store import here
from tracking.versions import CHAMPION, aliased, model_for, new_version


def validation_gate(cfg: RunConfig, day: Day, memory: Memory, champion, uri: str) -> dict:
    """PPL of the new version and of the champion on the day's validation articles (one LM pass).
    The validation articles are held out of calibration, though its early stopping reads them."""
    recorded, as_of = champion.tags["monim.memory"], champion.tags["monim.as_of"]
    root = here(uri, recorded, recorded)  # a copied work directory's champion: the copy's memory
    champ = memory.at(as_of) if Path(root) == memory.ds.root.resolve() else Memory.open(root, memory.lm, as_of)
    r = evaluate_many(memory.lm, day.validation, {"new": memory, "champion": champ}, Features.of(cfg, memory.lm),
                      f"{day.date}-validation")
    return {"gate_tokens": r["new"]["tokens"], "gate_ppl": r["new"]["ppl"], "gate_ppl_champion": r["champion"]["ppl"]}


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def register_day(cfg: RunConfig, day: Day, memory: Memory, run_id: str, uri: str) -> dict:
    """Register Θ as of a committed day as a new version (once per day and memory state), and move
    `champion` to it if its validation PPL is not worse than the champion's (never to an older day
    than the champion's); the gate's numbers are logged."""
    name, date = model_for(uri, cfg, run_id), day.date.isoformat()
    version, new = new_version(uri, name, workdirs.memory_root(cfg.workdir, cfg.name), date, memory.checksum(), run_id)
    if not new:
        return {"model_version": int(version), "registered": 0}
    champion = aliased(uri, name, CHAMPION)
    if champion is not None and champion.tags.get("monim.as_of", "") > date:
        logger().info("%s version %s (%s): not promoted; champion v%s is of a later day", name, version, date,
                      champion.version)
        return {"model_version": int(version), "registered": 1, "champion_moved": 0}
    with stage("validation search"):
        gate = validation_gate(cfg, day, memory, champion, uri) if champion is not None else {}
    promoted = settle(uri, name, version, None if champion is None else str(champion.version), gate)
    why = ("" if not gate else f"; the day has no validation articles to compare on: champion v{champion.version} stays"
           if not gate["gate_tokens"] else
           f"; validation PPL {gate['gate_ppl']:.2f} vs champion v{champion.version} {gate['gate_ppl_champion']:.2f}")
    logger().info("%s version %s (%s): %s%s", name, version, date, "champion" if promoted else "not promoted", why)
    return {"model_version": int(version), "registered": 1, "champion_moved": int(promoted)} | gate
