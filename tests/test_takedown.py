"""A takedown leaves nothing (issue 65): after `monim forget --doc`, no file of the work directory holds
the article's headline, text, token n-grams, lexical contexts or LM keys; a `--relearn` of its day
learns the day without it (as a feed without it would), and a near-duplicate of it is named and not
learned. Run through `monim` as a user runs it, on a small feed and a tiny model."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import demo_rows, learn, write_feed
from monim.lm.features import digest
from monim.storage.datastore import Datastore
from monim.storage.lexical import context_grams

pytestmark = pytest.mark.slow  # runs `monim learn`

DAYS = ("1987-03-02", "1987-03-03", "1987-03-04")


def found(workdir: Path, needles: dict[str, bytes]) -> dict[str, list[str]]:
    """Each needle's files: every byte of every file under the work directory searched (databases,
    logs, archives' stored members, caches)."""
    hits: dict[str, list[str]] = {}
    for path in sorted(p for p in workdir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for name, needle in needles.items():
            if needle in data:
                hits.setdefault(name, []).append(str(path.relative_to(workdir)))
    return hits


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def test_a_takedown_leaves_nothing_and_stays_out_of_a_relearn_and_of_near_duplicates(monim, model, tmp_path):
    from transformers import AutoTokenizer

    rows = demo_rows(3, 5)
    source, workdir = write_feed(tmp_path / "feed.jsonl", [r for r in rows if r["date"] <= DAYS[1]]), tmp_path / "w"
    learn(monim, source, workdir, model, check=True)
    ds = Datastore.read(workdir / "memories" / "fullmem")
    last = ds.days[-1]
    taken, *kept = ds.shards.shard_articles(last.shard)  # a training article of the last day: [id, title, text]
    doc_id, title, text = taken
    assert kept and title and doc_id in ds.shards.shard_docs(last.shard)

    # what would give the article away: its headline, its text, its token 8-grams (as any integer array
    # holds them), the lexical contexts only it has, and the LM's keys and hidden states of its tokens
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = tokenizer(text)["input_ids"]
    others = [tokenizer(a[2])["input_ids"] for d in ds.days for a in ds.shards.shard_articles(d.shard) if a[0] != doc_id]
    own = np.setdiff1d(context_grams(tokens), np.concatenate([context_grams(t) for t in others]))
    middle = len(tokens) // 2
    plain = re.findall(r"[A-Za-z0-9 ,.]{40,}", text)  # as any file would hold it (JSON escapes none of it)
    needles = {"title": title.encode(), "text": max(plain, key=len)[:60].encode(),
               "tokens": np.asarray(tokens[middle: middle + 8], np.int32).tobytes(),
               "lexical context": own[len(own) // 2].tobytes()}
    (folder,) = [p for p in (workdir / "features").glob(f"*/{last.date}-train-*")]
    row = next(start for h, start, n in json.loads((folder / "docs.json").read_text()) if h == digest(text)) + middle
    needles |= {field: np.load(folder / f"{field}.npy")[row].tobytes() for field in ("key", "hidden")}
    before = found(workdir, needles)
    assert set(before) == set(needles), f"the search cannot fail: {set(needles) - set(before)} found nowhere before the forget"

    out = monim.json("forget", "--workdir", workdir, "--doc", doc_id, "--reason", "takedown")
    assert out["removed"]["fullmem"] > 0
    assert found(workdir, needles) == {}, "a forgotten article left in the work directory"
    assert monim("fsck", "--workdir", workdir, check=False).returncode == 0

    # its day learned again (asked by name): without it, as a feed without it learns the day
    again = learn(monim, source, workdir, model, "--relearn", last.date, "--json", check=True)
    assert f"{doc_id}: forgotten" in again.stderr, again.stderr[-3000:]
    alone = tmp_path / "alone"
    learn(monim, write_feed(tmp_path / "without.jsonl", [r for r in rows if r["date"] <= DAYS[1] and str(r["id"]) != doc_id]),
          alone, model, check=True)
    relearned = Datastore.read(workdir / "memories" / "fullmem")
    reference = Datastore.read(alone / "memories" / "fullmem")
    day, want = relearned.days[-1], reference.days[-1]
    assert (day.date, day.tokens_seen, day.entries) == (want.date, want.tokens_seen, want.entries)
    assert doc_id not in relearned.shards.shard_docs(day.shard) and doc_id not in relearned.shards.shard_seen(day.shard)
    np.testing.assert_array_equal(relearned.shards.shard(day.shard, "values"), reference.shards.shard(want.shard, "values"))
    assert found(workdir, needles) == {}

    # the next day brings the same story under another id: named, not learned
    copy = {"id": "copy-of-it", "date": DAYS[2], "title": "Another headline", "text": text.replace(" the ", " a ", 1)}
    write_feed(source, [*rows, copy])
    nxt = learn(monim, source, workdir, model, "--json", check=True)
    assert "copy-of-it: a near-duplicate of a forgotten article" in nxt.stderr, nxt.stderr[-3000:]
    memory = Datastore.read(workdir / "memories" / "fullmem")
    assert memory.days[-1].date == DAYS[2] and "copy-of-it" not in memory.shards.shard_seen(memory.days[-1].shard)
    assert found(workdir, needles) == {}

    # a held-out article (read to evaluate, never learned, its text not kept) is taken down too
    first = memory.days[0]
    held_out = next(i for i in memory.shards.shard_seen(first.shard) if i not in memory.shards.shard_docs(first.shard))
    ids = tokenizer(next(r["text"] for r in rows if str(r["id"]) == held_out))["input_ids"]
    scored = {"tokens": np.asarray(ids[len(ids) // 2:][:8], np.int32).tobytes()}  # in the features it was scored into
    assert found(workdir, scored)
    out = monim.json("forget", "--workdir", workdir, "--doc", held_out, "--reason", "takedown")
    assert out["removed"]["fullmem"] == 0 and found(workdir, scored) == {}
    after = Datastore.read(workdir / "memories" / "fullmem")
    assert held_out not in after.shards.shard_seen(after.days[0].shard)
