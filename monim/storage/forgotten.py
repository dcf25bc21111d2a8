"""What a memory forgot, for good: each forget's days (with their articles' ids), documents, time and
reason, kept in the manifest's `forgotten` log, so that no resume, re-run, daily run or backfill learns
it again and its ids stay known (an id names one article); only a relearn asked by name
(`monim learn --relearn DAY`) brings a day back, and it is logged too. Of a document forgotten by id the
log keeps its MinHash fingerprint (never its text): a later record that is its near-duplicate is not learned."""

from __future__ import annotations

import datetime as dt

import numpy as np

from monim.data.dedup import NUM_PERM, Signatures


class ForgottenDay(ValueError):
    """A day the memory forgot, asked to be learned again without being named for it."""


def now() -> str:
    """The time of an event, UTC to the second."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def forget_event(days: dict[str, list[str]], docs: dict[str, str], reason: str | None,
                 prints: Signatures | None = None) -> dict:
    """A forget: the days forgotten whole (date -> the ids of the articles the day read), the documents
    (id -> the day that held it), when, why (the caller's words), and the documents' fingerprints
    (their MinHash signatures, in the order of `docs`, where their text was kept)."""
    event = {"when": now(), "reason": reason, "days": days, "docs": docs}
    if prints is not None and len(prints):
        event["fingerprints"] = {"hashes": prints.hashes.tolist(), "sizes": prints.sizes.tolist()}
    return event


def relearn_event(date: str) -> dict:
    """A forgotten day asked by name to be learned again."""
    return {"when": now(), "relearn": date}


def log(manifest: dict) -> list[dict]:
    return manifest.get("forgotten", [])


def forgotten_days(manifest: dict) -> dict[str, dict]:
    """The days forgotten whole and not relearned since: date -> the forget that did it."""
    out: dict[str, dict] = {}
    for event in log(manifest):
        if "relearn" in event:
            out.pop(event["relearn"], None)
        else:
            out |= {date: event for date in event["days"]}
    return out


def forgotten_ids(manifest: dict) -> dict[str, str]:
    """Every id a forget named (a forgotten day's articles, forgotten documents): id -> its day."""
    out: dict[str, str] = {}
    for event in log(manifest):
        out |= {i: date for date, ids in event.get("days", {}).items() for i in ids} | event.get("docs", {})
    return out


def forgotten_docs(manifest: dict) -> dict[str, str]:
    """The documents forgotten by id: id -> the day that held it (never learned again, even on a relearn of that day)."""
    return {i: date for event in log(manifest) for i, date in event.get("docs", {}).items()}


def fingerprints(manifest: dict) -> Signatures:
    """The MinHash signatures of every document forgotten by id (a near-duplicate of one is not learned)."""
    kept = [e["fingerprints"] for e in log(manifest) if "fingerprints" in e]
    return Signatures.concat([Signatures(np.array(f["hashes"], np.uint32).reshape(-1, NUM_PERM), np.array(f["sizes"], np.int64))
                              for f in kept])


def refuse(manifest: dict, date: str) -> None:
    """ForgottenDay where the memory forgot `date` (and no relearn brought it back)."""
    event = forgotten_days(manifest).get(date)
    if event is not None:
        why = f" ({event['reason']})" if event.get("reason") else ""
        raise ForgottenDay(f"day {date} was forgotten on {event['when']}{why}: it is not learned again unless asked by "
                           f"name (`monim learn --relearn {date}`)")


def check_relearn(manifest: dict, date: str) -> None:
    """ValueError unless `date` can be learned again: the memory's last day, or a day it forgot after it
    (a memory only grows at its end)."""
    days = [d["date"] for d in manifest.get("days", [])]
    if not (days and date == days[-1]) and not (date in forgotten_days(manifest) and (not days or date > days[-1])):
        raise ValueError(f"relearn {date}: only the memory's last day ({days[-1] if days else 'none'}) or a day "
                         "forgotten after it can be learned again (a memory only grows at its end)")


def summary(manifest: dict) -> list[dict]:
    """The log as rows to show (monim status, fsck): when, what, why."""
    rows = []
    for event in log(manifest):
        if "relearn" in event:
            rows.append({"when": event["when"], "what": f"day {event['relearn']} relearned", "reason": ""})
            continue
        what = [f"day {d} ({len(ids)} articles)" for d, ids in event["days"].items()] + \
               [f"document {i} ({d})" for i, d in event["docs"].items()]
        rows.append({"when": event["when"], "what": ", ".join(what), "reason": event.get("reason") or ""})
    return rows
