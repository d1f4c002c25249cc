# Load time, peak RSS and prefill time of model.py against transformers, side by side in one run.
# Writes a random checkpoint with Qwen2.5-0.5B-Instruct's shapes, then measures each implementation
# in a fresh process (so peak RSS is its own), alternating between the two.
#
#   python -m tools.bench_model                      # 0.5B shapes, 1x128 prefill, fp32 and bf16
#   python -m tools.bench_model --layers 2 --reps 1  # a quick smoke run
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mars import cli
from mars.hub import resolve_checkpoint
from tools.bench_train import model_config


@dataclass
class Settings:
    layers: int = 24  # Qwen2.5-0.5B has 24; fewer for a quick run
    seq_len: int = 128  # prefill length, batch 1
    reps: int = 2  # processes per (implementation, dtype); the median is reported
    forwards: int = 3  # timed forwards per process, after one warm-up
    threads: int = 2  # torch CPU threads
    ckpt: str = ""  # existing checkpoint (directory, hub id or alias) instead of a fresh random one
    child: list[str] = field(default_factory=list)  # internal: IMPL PATH DTYPE, one measured process


def peak_rss_gb() -> float:
    # VmHWM starts afresh at exec; getrusage's ru_maxrss would inherit the parent's peak across fork.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB -> GiB
    return float("nan")


def child(impl: str, path: str, dtype_name: str, s: Settings) -> dict:
    torch.set_num_threads(s.threads)
    dtype = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    if impl == "ours":
        from model import Transformer
        model = Transformer.from_pretrained(path, dtype=dtype).eval()
    else:
        from transformers import Qwen2ForCausalLM
        model = Qwen2ForCausalLM.from_pretrained(path, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    load_rss_gb = peak_rss_gb()
    x = torch.randint(min(1000, model.config.vocab_size), (1, s.seq_len))  # ids every checkpoint has
    times = []
    with torch.inference_mode():
        for _ in range(s.forwards + 1):
            t0 = time.perf_counter()
            out = model(x)
            _ = out if impl == "ours" else out.logits
            times.append(time.perf_counter() - t0)
    # Weights read lazily from a memory map count only once the forward touches them: report both.
    return {"load_s": load_s, "load_rss_gb": load_rss_gb, "peak_rss_gb": peak_rss_gb(),
            "forward_s": statistics.median(times[1:])}


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Load time, RSS and prefill time: ours against transformers.")
    if s.child:
        print(json.dumps(child(*s.child, s)))
        return

    from model import Transformer
    if min(s.reps, s.forwards, s.seq_len, s.threads, s.layers) < 1:
        sys.exit("error: --reps, --forwards, --seq-len, --threads and --layers must be at least 1")
    tmp = tempfile.TemporaryDirectory()
    try:  # absolute: the measuring processes run from the repository's folder
        path = str(resolve_checkpoint(s.ckpt).resolve()) if s.ckpt else ""
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    if not path:
        path = tmp.name
        c = replace(model_config("qwen2.5-0.5b-shapes"), num_hidden_layers=s.layers, tie_word_embeddings=True)
        torch.manual_seed(0)
        Transformer(c).to(torch.bfloat16).save_pretrained(path)  # bf16 on disk, as released
        print(f"random checkpoint with Qwen2.5-0.5B shapes ({s.layers} layers) in {path}", flush=True)

    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(s.reps):
        for dtype in ("float32", "bfloat16"):
            for impl in ("ours", "transformers"):  # alternate so drift hits both alike
                cmd = [sys.executable, "-m", "tools.bench_model", "--child", impl, path, dtype,
                       "--seq-len", str(s.seq_len), "--forwards", str(s.forwards),
                       "--threads", str(s.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
                if out.returncode:
                    sys.exit(f"{impl} {dtype} failed:\n{out.stderr[-2000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((impl, dtype), []).append(r)
                print(f"  rep {rep} {impl:12s} {dtype:8s} {r}", flush=True)

    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in results.items()}
    print(f"\n| dtype | impl | load s | RSS after load GiB | peak RSS GiB | 1x{s.seq_len} prefill s |")
    print("|---|---|---|---|---|---|")
    for (impl, dtype), r in med.items():
        print(f"| {dtype} | {impl} | {r['load_s']:.2f} | {r['load_rss_gb']:.2f} | {r['peak_rss_gb']:.2f} | "
              f"{r['forward_s']:.3f} |")
    for dtype in ("float32", "bfloat16"):
        o, t = med[("ours", dtype)], med[("transformers", dtype)]
        print(f"{dtype}: prefill time ours/transformers = {o['forward_s'] / t['forward_s']:.2f}, "
              f"load time ratio = {o['load_s'] / t['load_s']:.2f}")


if __name__ == "__main__":
    main()
