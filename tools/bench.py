# Decoding speed of MARS against AR with a KV cache, in one run with interleaved repetitions.
#
# For each batch size: AR (tau = 1 with the cursor cache, which is batched AR with a KV cache),
# MARS at each tau with the cursor cache (and the block cache at batches above 1), MARS
# self-verification (§9) in the tree and the chain layout, and transformers' generate as an outside
# AR baseline when transformers is installed. Reports medians of tok/s, tokens per forward and the
# wall-clock speed-up over AR at the same batch size; then what one forward costs: positions fed per
# row and its time against an AR forward (one position per row) at the same batch size.
#
#   python -m tools.bench --ckpt runs/demo/mars --prompts data/demo/test.jsonl --reps 3
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from generate import Options, decode
from mars import cli
from mars.adapter import is_adapter
from mars.checkpoint import DEFAULT_CKPT, adapter_base, check_checkpoint, load_model
from mars.cli import device_and_dtype
from mars.files import write_atomic
from mars.layout import LAYOUTS
from mars.prompts import encode_prompts
from mars.tokenizer import Tokenizer

# Used when no --prompts file is given, here and in bench_serve.py.
BUILTIN_PROMPTS = ["What is 17 + 25? Explain step by step.", "Write a short poem about the sea.",
                   "List three animals that live in the desert.", "Spell the word 'banana' backwards."]


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id or alias (qwen2.5-0.5b, qwen2.5-7b)
    prompts: str = ""  # JSONL prompts as for generate.py; empty = four built-in prompts
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    reps: int = 3  # timed repetitions of every configuration, interleaved; medians are reported
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16])  # prompts cycle to fill a batch
    thresholds: list[float] = field(default_factory=lambda: [0.95, 0.9, 0.8, 0.7])  # MARS tau values
    block_size: int = 4  # B, the MARS window
    block_cache_size: int = 32  # K for the block cache
    max_new_tokens: int = 256  # per prompt
    raw: bool = False  # prompts as plain text instead of chat user messages
    verify: bool = True  # also time self-verification (docs/method.md §9) in both layouts
    hf: bool = True  # also time transformers' generate (--no-hf skips it)
    json: str = ""  # also write every measurement to this JSON file


def timed(fn) -> tuple[float, list[list[int]], list[int]]:
    # (seconds, outputs, forwards per row) of one decode call. Its tokens come back as Python lists, read
    # from the device: the device has finished when it returns.
    t0 = time.perf_counter()
    out, forwards = fn()
    return time.perf_counter() - t0, out, forwards


def hf_runner(s: Settings, path: Path, tok: Tokenizer, device: str, dtype: torch.dtype):
    # transformers' greedy generate over a left-padded batch, counted like ours: up to the first stop.
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def run(batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        T = max(map(len, batch))
        ids = torch.tensor([[tok.pad_id] * (T - len(p)) + p for p in batch], device=device)
        attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=attn, max_new_tokens=s.max_new_tokens, do_sample=False,
                              eos_token_id=sorted(tok.stop_ids), pad_token_id=tok.pad_id)
        outs = []
        for row in gen[:, T:].tolist():
            stop = next((i for i, t in enumerate(row) if t in tok.stop_ids), len(row) - 1)
            outs.append(row[:stop + 1])
        return outs, [len(o) for o in outs]  # AR: one forward per token
    return run


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "MARS vs AR decoding speed (medians of interleaved repetitions).")
    cli.at_least_1(s, "reps", "batch_sizes", "block_size", "max_new_tokens")
    if s.json:
        cli.output_file(s.json, "--json")
    device, dtype = device_and_dtype(s.device, s.dtype)
    try:
        path, config = check_checkpoint(s.ckpt)
        tok = Tokenizer.from_pretrained(path)
        texts = [] if s.prompts else BUILTIN_PROMPTS
        prompts = encode_prompts(texts, s.prompts, s.raw, tok, s.max_new_tokens, config.max_position_embeddings)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    model = load_model(path, device, dtype)
    hf = None
    if s.hf:
        try:
            # an adapter run decodes AR as its base does (docs/method.md §10): transformers runs the base
            hf = hf_runner(s, adapter_base(path) if is_adapter(path) else path, tok, device, dtype)
        except ImportError:
            print("transformers is not installed: no outside baseline", file=sys.stderr)
    print({**asdict(s), "device": device, "dtype": str(dtype), "prompts_loaded": len(prompts)}, file=sys.stderr)

    # (batch size, method, cache, tau) -> a callable; AR first: the speed-ups are relative to it.
    # Verify rows have no tau (None): their tokens are AR's.
    runs, base = {}, Options(B=s.block_size, max_new_tokens=s.max_new_tokens, vocab_size=tok.vocab_size)

    def run(batch: list[list[int]], opts: Options):
        return lambda: decode(model, batch, tok.mask_id, tok.stop_ids, opts)
    for bs in s.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        runs[bs, "AR + KV cache", "cursor", 1.0] = run(batch, replace(base, tau=1.0))
        for tau in s.thresholds:
            for cache in ["cursor"] if bs == 1 else ["block", "cursor"]:
                K = s.block_cache_size if cache == "block" else 0
                runs[bs, f"MARS {cache}" + (f" K={K}" if K else ""), cache, tau] = run(
                    batch, replace(base, tau=tau, cache=cache, K=K))
        for layout in LAYOUTS if s.verify else []:
            runs[bs, f"MARS verify {layout}", "cursor", None] = run(batch, replace(base, verify=True, layout=layout))
        if hf:
            runs[bs, "transformers generate", "-", 1.0] = lambda b=batch: hf(b)

    times: dict[tuple, list[float]] = {key: [] for key in runs}
    tokens, forwards, fed = {}, {}, {}
    hidden = model.hidden
    for key, fn in runs.items():  # warm-up (kernels, allocator, caches), counting each forward's positions
        widths = []
        model.hidden = lambda x, *a, widths=widths, **k: widths.append(x.shape[1]) or hidden(x, *a, **k)
        fn()
        fed[key] = widths  # per forward: positions fed per row (rows are padded to the longest)
    del model.hidden  # the timed runs call the model's own method
    for _ in range(s.reps):
        for key, fn in runs.items():
            seconds, out, fwd = timed(fn)
            times[key].append(seconds)
            tokens[key], forwards[key] = sum(map(len, out)), sum(fwd)  # greedy: the same every rep

    rows = []
    for key, ts in times.items():
        bs, method, cache, tau = key
        ar = (bs, "AR + KV cache", "cursor", 1.0)
        tps, ar_tps = tokens[key] / statistics.median(ts), tokens[ar] / statistics.median(times[ar])
        # One forward of the batch: its median time, against an AR forward's at the same batch size
        # (transformers' forwards are not counted: it has no row in that table).
        step_s = statistics.median(ts) / max(len(fed[key]), 1)
        ar_step_s = statistics.median(times[ar]) / len(fed[ar])
        rows.append(dict(batch=bs, method=method, cache=cache, tau=tau, tokens_per_second=tps,
                         tokens_per_forward=tokens[key] / forwards[key], speedup=tps / ar_tps,
                         new_tokens=tokens[key], seconds=ts, batch_forwards=len(fed[key]),
                         positions_per_forward=statistics.mean(fed[key][1:] or fed[key] or [0]),
                         forward_ms=1000 * step_s, forward_vs_ar=step_s / ar_step_s))
    print("| batch | method | tau | tok/s | tokens/forward | speed-up vs AR | new tokens |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        tau = "exact" if r["tau"] is None else f"{r['tau']:.2f}"
        print(f"| {r['batch']} | {r['method']} | {tau} | {r['tokens_per_second']:.1f} | "
              f"{r['tokens_per_forward']:.2f} | {r['speedup']:.2f}x | {r['new_tokens']} |")
    # positions: the mean width of a forward after the prompt's, per row (the batch is padded to its widest row)
    print("\n| batch | method | tau | forwards | positions/forward | ms/forward | vs AR forward |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["method"] != "transformers generate":
            tau = "exact" if r["tau"] is None else f"{r['tau']:.2f}"
            print(f"| {r['batch']} | {r['method']} | {tau} | {r['batch_forwards']} | "
                  f"{r['positions_per_forward']:.1f} | {r['forward_ms']:.2f} | {r['forward_vs_ar']:.2f}x |")
    if s.json:
        write_atomic(Path(s.json), json.dumps({"settings": {**asdict(s), "device": device, "dtype": str(dtype)},
                                                "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
