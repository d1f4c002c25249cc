# What a MARS training step costs next to an AR step on the same batch (MARS.md §3 and §5: about 2x
# the time and 1.5x the memory without pruning). Random weights; times are medians of interleaved
# repetitions, so a machine that slows down mid-run slows every mode alike. Memory: the activations
# autograd saves (any device) and, on CUDA, the peak allocated.
#   python -m tools.bench_train --config small --batch-size 8 --seq-len 256 --prompt-frac 0.4
#   python -m tools.bench_train --config qwen2.5-0.5b-shapes --batch-size 8 --seq-len 512 --device cuda
from __future__ import annotations

import json
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

import cli
from data import make_batch
from model import Config, Transformer
from train import mars_loss

MODES = {"ar": ("ar", False), "mars": ("mars", False), "mars+prune": ("mars", True)}


@dataclass
class Settings:
    config: Literal["small", "qwen2.5-0.5b-shapes"] = "small"  # small: hidden 256, 4 layers; random weights
    batch_size: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence (a multiple of block_size)
    prompt_frac: float = 0.4  # mean share of a sequence that is prompt (unsupervised), +-0.1 per row
    block_size: int = 4  # B
    steps: int = 5  # timed repetitions per mode, after one warmup
    device: str = "auto"  # auto (cuda when present) or cpu
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # bfloat16 autocast (auto on CUDA) or float32 (auto on CPU)
    seed: int = 0  # batch contents and weights


def model_config(name: str) -> Config:
    if name == "small":
        return Config(vocab_size=260, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                      max_position_embeddings=4096, torch_dtype="float32")
    if name == "qwen2.5-0.5b-shapes":  # QWEN2.md §2
        return Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768)


def chat_batch(s: Settings, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    # seq_len tokens per row: a prompt of ~prompt_frac * seq_len, then the supervised answer.
    rng = random.Random(s.seed)
    rows = []
    for _ in range(s.batch_size):
        frac = min(0.95, max(0.0, s.prompt_frac + rng.uniform(-0.1, 0.1)))
        prompt = max(1, int(frac * s.seq_len))
        ids = np.array([rng.randrange(vocab - 8) for _ in range(s.seq_len)])
        rows.append((ids, np.arange(s.seq_len) >= prompt))
    return rows


def setup(s: Settings):
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if s.device == "auto" else s.device)
    compute = s.dtype if s.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if compute == "bfloat16" else nullcontext()
    torch.manual_seed(s.seed)
    c = model_config(s.config)
    model = Transformer(c).to(device)  # float32 weights, as train.py
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=device.type == "cuda")
    for p in model.parameters():  # allocate AdamW's state now, so no mode pays for it
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows = chat_batch(s, c.vocab_size)
    mask_id, pad_id = c.vocab_size - 1, c.vocab_size - 2  # any ids do for random weights
    batches = {name: make_batch(rows, s.block_size, mask_id, pad_id, mode, prune).to(device)
               for name, (mode, prune) in MODES.items()}
    return device, compute, autocast, model, opt, batches


def train_step(model, opt, batch, autocast, device) -> tuple[float, float]:
    # -> (seconds for forward + backward, seconds for the whole step with AdamW). The forward and
    # backward are what MARS changes; AdamW costs the same in every mode, and on a CPU at small
    # batches it can dominate the step.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with autocast:
        loss = mars_loss(model, batch)[0]
    loss.backward()
    sync()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return t1 - t0, time.perf_counter() - t0


def saved_mb(model, batch, autocast) -> float:
    # Activation memory, exactly and on any device: the bytes autograd keeps for the backward
    # (each storage once, parameters excluded). This is what grows with the sequence.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            sizes[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = mars_loss(model, batch)[0]
    del loss
    return sum(sizes.values()) / 2**20


def matmul_gflop(c: Config, batch) -> float:
    # Matmul FLOPs of forward + backward (3x forward), what a GPU's time follows at scale: the
    # linear layers on every column, attention over T x T (half of it when plain causal, as
    # SDPA's is_causal skips the upper triangle; an explicit mask does not), the head on targets.
    N, T = batch.tokens.shape
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_token = 2 * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    attention = 4 * T * T * q * (0.5 if batch.noisy is None else 1.0)
    layers = c.num_hidden_layers * (N * T * per_token + N * attention)
    head = 2 * c.hidden_size * c.vocab_size * int((batch.labels != -100).sum())
    return 3 * (layers + head) / 1e9


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Time and memory of a MARS step vs an AR step.")
    if s.seq_len % s.block_size:
        raise SystemExit(f"--seq-len {s.seq_len} is not a multiple of --block-size {s.block_size}")
    device, compute, autocast, model, opt, batches = setup(s)
    print(json.dumps(asdict(s)), f"device={device} compute={compute} threads={torch.get_num_threads()}")

    fwd_bwd, step, peak = {n: [] for n in MODES}, {n: [] for n in MODES}, {}
    for rep in range(s.steps + 1):  # interleaved: ar, mars, mars+prune, ar, ...
        for name, batch in batches.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            a, b = train_step(model, opt, batch, autocast, device)
            if rep > 0:  # rep 0 warms up kernels and the allocator
                fwd_bwd[name].append(a)
                step[name].append(b)
            if device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated() / 2**20
    saved = {name: saved_mb(model, batch, autocast) for name, batch in batches.items()}
    flop = {name: matmul_gflop(model.config, batch) for name, batch in batches.items()}

    med = {name: (float(np.median(fwd_bwd[name])), float(np.median(step[name]))) for name in MODES}
    head = f"\n{'mode':<11} {'columns':>7} {'fwd+bwd ms':>11} {'x AR':>5} {'step ms':>9} {'x AR':>5} "
    head += f"{'GFLOP':>7} {'x AR':>5} {'saved MB':>9} {'x AR':>5}"
    head += f" {'peak MB':>8} {'x AR':>5}" if peak else ""
    print(head)
    for name, batch in batches.items():
        (a, b), (a0, b0) = med[name], med["ar"]
        line = (f"{name:<11} {batch.tokens.shape[1]:>7} {a * 1e3:>11.1f} {a / a0:>5.2f} {b * 1e3:>9.1f} "
                f"{b / b0:>5.2f} {flop[name]:>7.1f} {flop[name] / flop['ar']:>5.2f} "
                f"{saved[name]:>9.0f} {saved[name] / saved['ar']:>5.2f}")
        if peak:
            line += f" {peak[name]:>8.0f} {peak[name] / peak['ar']:>5.2f}"
        print(line)


if __name__ == "__main__":
    main()
