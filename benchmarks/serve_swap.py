"""The champion moves while clients ask: failed requests, seconds to the new version, forgotten sources cited.

The champion moves while clients ask: 16 clients continue prompts (sources on) against
`monim serve-model` while the work directory learns its next day (then promoted, if the gate kept
the champion) and then forgets the article the answers cite most. Reported: failed requests (must
be 0), the seconds from each move of the alias (seen in the registry) to the server answering with
the new version (seen in its /health), and the answers to requests sent after that which still
cite the forgotten article (must be 0).
It changes the work directory (a day learned, an article forgotten). `benchmarks/serve_load.py`
runs it last; alone: monim bench serve-swap --workdir W --port P (a server already following W).
"""

from benchmarks.harness import monim_json, parser, requests_pool, save
import sys
import threading
import time
from pathlib import Path

from rich.table import Table

from monim.storage.datastore import Datastore
from monim.core.config import DEMO_STREAM
from monim.data.stream import list_dates
from servers.client import Clients, health

BIN = Path(sys.executable).parent
POLICY = "monim-amt"  # the memory `monim serve-model` serves by default in a demo work directory


class Timeline:
    """When the alias moved to each version (the registry, looked at every `every` s) and when the server
    began answering with it (its /health): the time to follow is the difference."""

    def __init__(self, port: int, workdir: Path, every: float = 0.25):
        from tracking.store import tracking_uri
        from tracking.versions import find_version

        self.moved: dict[str, float] = {}
        self.served: dict[str, float] = {}
        self._stop = threading.Event()
        uri, root = tracking_uri(str(workdir), None), workdir / "memories" / POLICY

        def watch() -> None:
            while not self._stop.wait(every):
                try:
                    now = time.monotonic()
                    self.moved.setdefault(find_version(uri, root)["version"], now)
                    self.served.setdefault(health(port)["version"], time.monotonic())
                except (OSError, ValueError) as e:  # the registry or the server busy: look again
                    print(f"timeline: {e!r}", file=sys.stderr)

        self._thread = threading.Thread(target=watch)
        self._thread.start()

    def follow(self, version: str, bound: float = 180.0) -> float:
        """Seconds from the alias's move to `version` to the server answering with it (waiting for both)."""
        started = time.monotonic()
        while version not in self.served or version not in self.moved:
            if time.monotonic() - started > bound:
                raise SystemExit(f"the server did not follow version {version} within {bound:.0f} s")
            time.sleep(0.1)
        return max(0.0, self.served[version] - self.moved[version])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def swap(port: int, workdir: Path, prompts: list[str], clients: int = 16, new_tokens: int = 16,
         max_docs: int = 16) -> dict:
    """The two moves under load (a new day of `max_docs` articles, as `monim run` learns them; then a forget), measured."""
    ds = Datastore.read(workdir / "memories" / POLICY)
    last = ds.days[-1].date
    learned = [d.isoformat() for d in list_dates(DEMO_STREAM) if d.isoformat() > last]
    if not learned:
        raise SystemExit(f"{workdir}: the demo stream has no day after {last} left to learn")
    day = learned[0]
    bodies = [{"dataframe_records": [{"prompt": p}], "params": {"max_new_tokens": new_tokens, "sources": 10}} for p in prompts]
    load, timeline = Clients(port, bodies, clients), Timeline(port, workdir)
    try:
        t = time.monotonic()
        monim_json("learn", "--source", str(DEMO_STREAM), "--start", day, "--end", day, "--policy", POLICY,
              "--workdir", str(workdir), "--max-docs", str(max_docs), "--model", ds.manifest["model"])
        learn_s = time.monotonic() - t
        new_day = monim_json("promote", "--workdir", str(workdir), "--policy", POLICY)["champion"]
        follow_day = timeline.follow(new_day)
        time.sleep(5)
        victim, _ = load.cited(timeline.served[new_day]).most_common(1)[0]
        forget = monim_json("forget", "--workdir", str(workdir), "--policy", POLICY, "--doc", victim)
        after_forget = forget["registered"][POLICY]["champion"]
        follow_forget = timeline.follow(after_forget)
        followed = timeline.served[after_forget]
        time.sleep(10)
    finally:
        load.stop()
        timeline.stop()
    failed = [(status, out.get("message", "")[:120]) for _, status, out in load.asked if status != 200]
    return {"clients": clients, "requests": len(load.asked), "failed": len(failed), "failed_examples": failed[:3],
            "learned_day": day, "learn_s": learn_s, "version_new_day": new_day, "follow_new_day_s": follow_day,
            "forgotten": victim, "forgotten_entries": forget["removed"][POLICY], "version_after_forget": after_forget,
            "follow_forget_s": follow_forget,
            "cites_forgotten_after_follow": load.cited(followed)[victim],
            "requests_after_follow": len(load.answered(followed))}


def swap_table(r: dict) -> Table:
    table = Table(title=f"the champion moves while {r['clients']} clients ask ({r['requests']} requests)")
    for col in ("move", "version", "follow s", "failed requests", "cite the forgotten article after"):
        table.add_column(col, justify="right")
    table.add_row(f"day {r['learned_day']} learned ({r['learn_s']:.0f} s) and promoted", r["version_new_day"],
                  f"{r['follow_new_day_s']:.1f}", "", "")
    table.add_row(f"forget {r['forgotten']} ({r['forgotten_entries']} entries)", r["version_after_forget"],
                  f"{r['follow_forget_s']:.1f}", "", f"{r['cites_forgotten_after_follow']} of {r['requests_after_follow']}")
    table.add_row("whole phase", "", "", str(r["failed"]), "")
    return table


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    ap = parser(__doc__, "serve-swap")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-docs", type=int, default=16, help="Articles of the day learned (the work directory's own).")
    args = ap.parse_args(argv)
    prompts = [r["dataframe_records"][0]["prompt"] for r in requests_pool(0, 12, 16)]
    result = swap(args.port, args.workdir, prompts, args.clients, max_docs=args.max_docs)
    Console(width=150).print(swap_table(result))
    save(args.out, result, args)


if __name__ == "__main__":
    main()
