"""Where the GPU goals are lost: the device search's rate by k, transformers' own decoding, the decoder's profile.

On one GPU (~40 s on an H200; run beside `monim bench gpu` in the same lease): the tiled exact search
(TorchExact.search_on) over 1M keys of width 576 at k = 16, 128 and 1,024 for 4,096 queries, against its
matrix product alone and plain torch.topk over the whole product; transformers' own cached greedy step loop
at 1 and 16 rows (SmolLM2-135M's shape, random weights, bf16); and a profile of the bare Decoder's 64 steps
at batch 1, by Python's time. Usage: monim bench gpu-diagnosis [--out FILE] (FILE: $OUT/gpu-diagnosis.json
if $OUT is set); on a machine without typer: python -m benchmarks.gpu_diagnosis
"""

import cProfile
import io
import os
import pstats
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks import gpu
from benchmarks.harness import parser, save
from monim.serving.generate import Decoder
from monim.serving.generation import GenerateConfig
from monim.storage.torch_search import TorchExact


def seconds(fn, reps: int = 3) -> float:
    """The mean seconds of fn on the GPU, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / reps


def searches(dev: torch.device) -> dict:
    """Queries/s of the tiled exact search at k = 16, 128 and 1,024, of the matrix product alone, and of plain topk."""
    keys, ids = gpu.random_keys(1_000_000, 576, dev)
    index, q, res = TorchExact(keys, ids), keys[torch.randint(0, 1_000_000, (4096,), device=dev)] + 0.1, {}
    for k in (16, 128, 1024):
        res[f"search_on_1M_k{k}_queries_per_s"] = 4096 / seconds(lambda: index.search_on(q, k))
    res["matmul_only_1M_queries_per_s"] = 4096 / seconds(lambda: [q @ keys[lo : lo + (1 << 20)].T for lo in range(0, len(keys), 1 << 20)])
    for k in (16, 1024):
        res[f"plain_matmul_topk{k}_1M_queries_per_s"] = 4096 / seconds(lambda: torch.topk(q @ keys.T, k, dim=1))
    return res


def step_loop(model, rows: int, dev: torch.device, new: int = 128) -> None:
    """transformers' own greedy decoding with its KV cache: 64-token prompts, `new` tokens."""
    x = torch.randint(1, model.config.vocab_size, (rows, 64), device=dev)
    with torch.inference_mode():
        out = model(input_ids=x, past_key_values=DynamicCache(config=model.config), use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new - 1):
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "gpu-diagnosis")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("it measures a GPU: torch sees none here")
    if "--out" not in ap.argv and os.environ.get("OUT"):  # the lent GPU machine's folder that comes back
        args.out = Path(os.environ["OUT"]) / "gpu-diagnosis.json"
    dev = torch.device("cuda")
    res = searches(dev)
    torch.cuda.empty_cache()
    lm = gpu.random_lm("smollm2-135m", dev, torch.bfloat16)
    for rows in (1, 16):
        res[f"hf_step_loop_rows{rows}_tokens_per_s"] = rows * 128 / seconds(lambda: step_loop(lm.model, rows, dev), reps=2)
    print(res, flush=True)
    cfg = GenerateConfig(max_new_tokens=64, temperature=0.0)

    def decode() -> None:
        decoder = Decoder(lm, None, max_rows=1)
        decoder.add(" ".join(map(str, range(1, 65))), cfg)
        while decoder:
            decoder.advance()

    decode()
    profile = cProfile.Profile()
    profile.enable()
    decode()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
    res["decoder_64_steps_profile_by_tottime"] = text.getvalue()
    save(args.out, res, args)
    print(text.getvalue()[:5000])


if __name__ == "__main__":
    main()
