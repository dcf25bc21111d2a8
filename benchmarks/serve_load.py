"""The served champion under 1 to 64 concurrent clients: requests/s, latency, errors, wrong answers.

The served champion under load: 1, 4, 16 and 64 concurrent clients on loopback, each sending a
mix of scoring and generation rows to `monim serve-model`; per level: requests/s, tokens/s, latency
percentiles, errors and WRONG answers (each response against the same request answered alone:
a perplexity off by more than 1e-4 relative, or other generated tokens). Then the LM's own forward
throughput on the same texts (the physical bound) in this process, and a SIGTERM to the server with
requests in flight: how long it takes to stop, and whether any process it started is left.
Decoding: prompts alone (no text rows) from 1 and 16 clients against the bare LM's own KV-cache
decoding of the same prompts in this process (generated tokens/s, the ratios), and the time to a
first token: of a served request once ready, and of `monim generate` as a whole process beside `monim --help`.
Then the champion moves while 16 clients ask (benchmarks/serve_swap.py: a new day learned and promoted,
then a forget; it changes the work directory, `--no-swap` leaves it as it is).
Bounded: each level sends `--requests-per-client` requests per client and stops after `--level-seconds`.
Usage: monim bench serve-load [--workdir monim-demo] (made with `monim run` when missing)
"""

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.harness import REPO, parser, requests_pool, save
import numpy as np
import psutil
import torch
from rich.console import Console
from rich.table import Table

from monim.lm.model import load_lm
from servers.client import post
from benchmarks.serve_swap import swap, swap_table

BIN = Path(sys.executable).parent


def same(a: dict, b: dict) -> bool:
    """Whether an answer agrees with the one given alone (scores within 1e-4 relative; the same tokens,
    or their beginning where the continuation was stopped by its time limit)."""
    if "ppl" in a:
        return a["tokens"] == b["tokens"] and abs(a["ppl"] - b["ppl"]) <= 1e-4 * b["ppl"]
    cut = a.get("stopped", "").startswith("time limit")
    return a["tokens"] == (b["tokens"][: len(a["tokens"])] if cut else b["tokens"])


def difference(a: dict, b: dict) -> str:
    """How a wrong answer differs from the one given alone."""
    if "ppl" in a:
        return f"text: PPL {a['ppl']:.6g} vs {b['ppl']:.6g} alone, {a['tokens']} vs {b['tokens']} tokens"
    return f"prompt: {a['text']!r} vs {b['text']!r} alone (stopped: {a.get('stopped')})"


def level(port: int, clients: int, pool: list[dict], reference: list[dict], per_client: int, seconds: float) -> dict:
    """`clients` threads, each sending `per_client` requests (round robin over the pool), within `seconds`."""
    latencies, errors, wrong, cut, tokens, done = [], [], [], 0, {"scored": 0, "generated": 0}, 0
    lock, deadline = threading.Lock(), time.monotonic() + seconds

    def client(c: int) -> None:
        nonlocal cut, done
        for i in range(per_client):
            if time.monotonic() > deadline:
                return
            k = (c * per_client + i) % len(pool)
            t = time.perf_counter()
            status, out = post(port, pool[k])
            took = time.perf_counter() - t
            with lock:
                latencies.append(took)
                if status != 200:
                    errors.append(f"{status} {out.get('message', '')[:120]}")
                    continue
                done += 1
                answer = out["predictions"][0]
                cut += answer.get("stopped", "").startswith("time limit")
                if not same(answer, reference[k]):
                    wrong.append(difference(answer, reference[k]))
                tokens["scored" if "ppl" in answer else "generated"] += answer["tokens"] if "ppl" in answer else len(answer["tokens"])

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    lat = np.array(latencies) if latencies else np.array([np.nan])
    return {"clients": clients, "requests": done, "errors": len(errors), "error_examples": errors[:3], "wrong": len(wrong),
            "wrong_examples": wrong[:5], "cut_by_time_limit": cut,
            "requests_per_s": done / wall, "scored_tokens_per_s": tokens["scored"] / wall,
            "generated_tokens_per_s": tokens["generated"] / wall, "p50_s": float(np.percentile(lat, 50)),
            "p95_s": float(np.percentile(lat, 95)), "p99_s": float(np.percentile(lat, 99)), "wall_s": wall}


def lm_bound(texts: list[str]) -> dict:
    """The LM body's forward tokens/s on the same texts, packed into full 512-token rows (8 a pass)."""
    lm = load_lm()
    ids = [t for text in texts for t in lm.tokenizer(text)["input_ids"]]
    flat = torch.tensor(ids[: len(ids) // 512 * 512]).view(-1, 512)
    with torch.inference_mode():
        lm.forward(flat[:1, :64])
        t = time.perf_counter()
        for i in range(0, len(flat), 8):
            lm.forward(flat[i : i + 8])
        return {"tokens": flat.numel(), "body_tokens_per_s": flat.numel() / (time.perf_counter() - t)}


def bare_decoding(lm, prompts: list[str], new_tokens: int) -> dict:
    """The bare LM's own KV-cache decoding of the prompts, one after another (greedy, `new_tokens` each):
    generated tokens/s, prefill included (as in a served continuation)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        started = time.perf_counter()
        for prompt in prompts:
            ids, cache = torch.tensor([lm.tokenizer(prompt)["input_ids"]]), DynamicCache(config=lm.model.config)
            for _ in range(new_tokens):
                hidden, _ = lm.forward(ids, past=cache)
                ids = lm.logits(hidden[:, -1]).argmax(-1, keepdim=True)
        took = time.perf_counter() - started
    return {"prompts": len(prompts), "tokens": len(prompts) * new_tokens, "tokens_per_s": len(prompts) * new_tokens / took}


def decoding(port: int, prompts: list[dict], per_client: int, seconds: float) -> dict:
    """Prompts alone from 1 and 16 clients: each answer against the same request's alone (the pool's
    first answers), generated tokens/s and latency per level, and 16 clients' tokens/s over 1 client's."""
    reference = [post(port, body)[1]["predictions"][0] for body in prompts]
    levels = {c: level(port, c, prompts, reference, per_client, seconds) for c in (1, 16)}
    return {"levels": list(levels.values()),
            "ratio_16_to_1": levels[16]["generated_tokens_per_s"] / levels[1]["generated_tokens_per_s"]}


def first_tokens(port: int, workdir: Path, prompt: str, repeats: int = 3) -> dict:
    """Seconds to a first token: a served request (max_new_tokens 1) just after the server is ready, then
    warm; `monim generate --max-new-tokens 1` as a whole process beside `monim --help` (median of `repeats`)."""
    body = {"dataframe_records": [{"prompt": prompt}], "params": {"max_new_tokens": 1}}
    served = []
    for _ in range(repeats):
        t = time.perf_counter()
        status, out = post(port, body)
        assert status == 200, out
        served.append(time.perf_counter() - t)
    cli = str(BIN / "monim")

    def process(*args: str) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            subprocess.run([cli, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    return {"served_first_s": served[0], "served_warm_s": float(np.median(served[1:])),
            "generate_process_s": process("generate", "--workdir", str(workdir), "--prompt", prompt, "--max-new-tokens", "1"),
            "help_process_s": process("--help"), "import_torch_s": _seconds([sys.executable, "-c", "import torch"])}


def _seconds(command: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - t


def decoding_table(decode: dict, bare: dict, first: dict) -> Table:
    """The decoding phase beside the bare LM, with the ratios the goals name, and the first-token times."""
    table = Table(title=f"decoding {bare['tokens'] // bare['prompts']} tokens a prompt (Θ served vs the bare LM's KV-cache "
                        "decoding in this process)")
    for col in ("", "requests", "generated tok/s", "vs bare LM", "p50 s", "p95 s", "errors", "cut", "wrong"):
        table.add_column(col, justify="right")
    table.add_row("bare LM, batch 1", str(bare["prompts"]), f"{bare['tokens_per_s']:.1f}", "1.00", "", "", "", "", "")
    for r in decode["levels"]:
        table.add_row(f"Θ, {r['clients']} client{'s' * (r['clients'] > 1)}", str(r["requests"]),
                      f"{r['generated_tokens_per_s']:.1f}", f"{r['generated_tokens_per_s'] / bare['tokens_per_s']:.2f}",
                      f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}", str(r["errors"]), str(r["cut_by_time_limit"]), str(r["wrong"]))
    table.caption = (f"16 clients / 1 client: {decode['ratio_16_to_1']:.2f}x; first token: served {first['served_first_s']:.2f} s "
                     f"once ready ({first['served_warm_s']:.2f} s warm), `monim generate` {first['generate_process_s']:.2f} s "
                     f"as a process (`monim --help` {first['help_process_s']:.2f} s, `import torch` {first['import_torch_s']:.2f} s)")
    return table


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "serve-load")
    ap.add_argument("--workdir", type=Path, default=REPO / "monim-demo")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--level-seconds", type=float, default=300)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=5055)
    ap.add_argument("--no-swap", action="store_true", help="Leave the champion where it is (no day learned, nothing forgotten).")
    args = ap.parse_args(argv)
    console = Console(width=150)
    cli = str(BIN / "monim")
    if not (args.workdir / "mlflow.db").exists():
        subprocess.run([cli, "run", "--workdir", str(args.workdir)], check=True)
    server = subprocess.Popen([cli, "serve-model", "--workdir", str(args.workdir), "--port", str(args.port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started = time.perf_counter()
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/ping", timeout=2)
            break
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the server did not start:\n{server.stderr.read()[-3000:]}")
            time.sleep(0.5)
    ready = time.perf_counter() - started
    pool = requests_pool(24, 12, args.new_tokens)
    prompts = [r for r in pool if "prompt" in r["dataframe_records"][0]]
    first = first_tokens(args.port, args.workdir, "The Bank of Japan said")
    reference = []
    for body in pool:  # each request answered alone: the reference every later answer must equal
        status, out = post(args.port, body)
        assert status == 200, out
        reference.append(out["predictions"][0])
    results = {"ready_s": ready, "levels": [level(args.port, c, pool, reference, args.requests_per_client, args.level_seconds)
                                            for c in map(int, args.levels.split(","))]}
    results["decode"] = decoding(args.port, prompts, args.requests_per_client, args.level_seconds)
    texts = [r["dataframe_records"][0]["text"] for r in pool if "text" in r["dataframe_records"][0]]
    results["bound"] = lm_bound(texts)
    results["decode"]["bare_lm"] = bare_decoding(load_lm(), [r["dataframe_records"][0]["prompt"] for r in prompts],
                                                 args.new_tokens)
    results["decode"]["theta_1_vs_bare"] = (results["decode"]["levels"][0]["generated_tokens_per_s"]
                                            / results["decode"]["bare_lm"]["tokens_per_s"])
    results["first_token"] = first
    if not args.no_swap:
        results["swap"] = swap(args.port, args.workdir, [r["dataframe_records"][0]["prompt"] for r in prompts])
    at16 = next((r for r in results["levels"] if r["clients"] == 16), results["levels"][-1])
    results["scoring_vs_bound_at_16"] = at16["scored_tokens_per_s"] / results["bound"]["body_tokens_per_s"]
    # a stop with requests in flight
    children = psutil.Process(server.pid).children(recursive=True)
    flying = [threading.Thread(target=post, args=(args.port, pool[i % len(pool)], 60)) for i in range(8)]
    for t in flying:
        t.start()
    time.sleep(1.0)
    t = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    stop_s = time.perf_counter() - t
    for th in flying:
        th.join()
    alive = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    results["stop"] = {"seconds": stop_s, "exit_code": server.returncode, "processes_left": alive}

    table = Table(title=f"monim serve-model on loopback (ready in {ready:.1f} s; LM body {results['bound']['body_tokens_per_s']:.0f} tok/s)")
    for col in ("clients", "requests", "req/s", "scored tok/s", "generated tok/s", "p50 s", "p95 s", "p99 s", "errors", "cut",
                "wrong"):
        table.add_column(col, justify="right")
    for r in results["levels"]:
        table.add_row(str(r["clients"]), str(r["requests"]), f"{r['requests_per_s']:.2f}", f"{r['scored_tokens_per_s']:.0f}",
                      f"{r['generated_tokens_per_s']:.1f}", f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}", f"{r['p99_s']:.2f}",
                      str(r["errors"]), str(r["cut_by_time_limit"]), str(r["wrong"]))
    console.print(table)
    for r in results["levels"]:
        for w in r["wrong_examples"]:
            console.print(f"wrong at {r['clients']} clients: {w}")
    console.print(decoding_table(results["decode"], results["decode"]["bare_lm"], first))
    if "swap" in results:
        console.print(swap_table(results["swap"]))
    console.print(f"scoring at 16 clients: {results['scoring_vs_bound_at_16']:.2f}x the LM body's forward throughput; "
                  f"SIGTERM with 8 requests in flight: stopped in {stop_s:.1f} s (exit {server.returncode}), "
                  f"processes left: {alive or 'none'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, results, args)


if __name__ == "__main__":
    main()
