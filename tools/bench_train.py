# What a MARS training step costs next to an AR step on the same batch (docs/method.md §3 and §5: about 2x
# the time and 1.5x the memory without pruning). Random weights; times are medians of interleaved
# repetitions, so a machine that slows down mid-run slows every mode alike. Memory: the activations
# autograd saves (any device), the largest logits tensor (rows x vocabulary, float32) and, on CUDA,
# the peak allocated. Modes: ar; mars (no pruning); mars+prune (train.py's default); 1-call
# (mars+prune with the whole (T, T) mask in one attention call: the reference the split replaces);
# adapter (the gated mask adapter, rank 16, on a frozen base: docs/method.md §10). state MB: weights,
# gradients and AdamW state that a mode keeps (a frozen base: its weights alone).
#   python -m tools.bench_train --config small --batch-size 8 --seq-len 256 --prompt-frac 0.4
#   python -m tools.bench_train --config qwen2.5-0.5b-shapes --batch-size 8 --seq-len 512 --device cuda
from __future__ import annotations

import json
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data import IGNORE, make_batch
from mars import adapter, cli
from mars.files import write_atomic
from model import Config, Transformer
from train import loss_variant, mars_loss

MODES = {"ar": ("ar", False, True), "mars": ("mars", False, True), "mars+prune": ("mars", True, True),
         "1-call": ("mars", True, False), "adapter": ("mars", True, True)}  # name: (mode, prune, split attention)


@dataclass
class Settings:
    config: Literal["small", "qwen2.5-0.5b-shapes"] = "small"  # small: hidden 256, 4 layers; random weights
    batch_size: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence (a multiple of block_size)
    prompt_frac: float = 0.4  # mean share of a sequence that is prompt (unsupervised), +-0.1 per row
    block_size: int = 4  # B
    ce_chunk: int = 2048  # targets per LM-head + cross-entropy chunk, as train.py; 0 = all at once
    steps: int = 5  # timed repetitions per mode, after one warmup
    device: str = "auto"  # auto (cuda when present) or cpu
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # bfloat16 autocast (auto on CUDA) or float32 (auto on CPU)
    seed: int = 0  # batch contents and weights
    json: str = ""  # also write the settings and every mode's numbers to this JSON file


def model_config(name: str) -> Config:
    if name == "small":
        return Config(vocab_size=260, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                      max_position_embeddings=4096, torch_dtype="float32")
    if name == "qwen2.5-0.5b-shapes":  # docs/method.md §12
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


def mode_batch(s: Settings, vocab: int, name: str, device: torch.device):
    # The batch of MODES[name] over chat_batch's rows; the vocabulary's last two ids are the mask and the pad
    # (any ids do for random weights).
    mode, prune, _ = MODES[name]
    return make_batch(chat_batch(s, vocab), s.block_size, vocab - 1, vocab - 2, mode, prune).to(device)


def setup(s: Settings):
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if s.device == "auto" else s.device)
    cli.keep_freed_memory(device)  # as train.py
    compute = s.dtype if s.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if compute == "bfloat16" else nullcontext()
    torch.manual_seed(s.seed)
    c = model_config(s.config)
    model = Transformer(c).to(device)  # float32 weights, as train.py
    mask_id = c.vocab_size - 1  # mode_batch's
    # the adapter's base: a frozen copy in the compute dtype, as train.py
    base = Transformer(c).to(device, getattr(torch, compute))
    base.load_state_dict(model.state_dict())
    adapter.attach(base, mask_id, rank=16, alpha=32.0)
    base.adapter.float()
    models = {name: base if name == "adapter" else model for name in MODES}
    opts = {}
    for m in (model, base):  # allocate AdamW's state now, so no mode pays for it
        params = [p for p in m.parameters() if p.requires_grad]
        opts[id(m)] = torch.optim.AdamW(params, lr=0.0, fused=device.type == "cuda")
        for p in params:
            p.grad = torch.zeros_like(p)
        opts[id(m)].step()
        opts[id(m)].zero_grad(set_to_none=True)
    batches = {name: mode_batch(s, c.vocab_size, name, device) for name in MODES}
    return device, compute, autocast, models, {n: opts[id(m)] for n, m in models.items()}, batches


def state_mb(model: Transformer) -> float:
    # Weights (any dtype), plus for each trained parameter its float32 gradient and two AdamW moments.
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (held + 12 * trained) / 2**20


def loss_of(model, batch, name: str, s: Settings) -> torch.Tensor:
    if name == "adapter":
        return mars_loss(model, batch, chunk=s.ce_chunk, variant=loss_variant("self", "gated-lora"))[0]
    return mars_loss(model, batch, chunk=s.ce_chunk, split=MODES[name][2])[0]


def train_step(model, opt, batch, name, s, autocast, device) -> tuple[float, float]:
    # -> (seconds for forward + backward, seconds for the whole step with AdamW). The forward and
    # backward are what MARS changes; AdamW costs the same in every mode, and on a CPU at small
    # batches it can dominate the step.
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with autocast:
        loss = loss_of(model, batch, name, s)
    loss.backward()
    sync()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return t1 - t0, time.perf_counter() - t0


def saved_mb(model, batch, name, s, autocast) -> float:
    # Activation memory, exactly and on any device: the bytes autograd keeps for the backward
    # (each storage once). This is what grows with the sequence. Left out: the parameters, and
    # under bf16 autocast their bf16 copies (tensors of a parameter's shape in another dtype).
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {p.shape for p in model.parameters()}
    sizes = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and not (t.shape in shapes and t.dtype != torch.float32):
            sizes[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = loss_of(model, batch, name, s)
    del loss
    return sum(sizes.values()) / 2**20


class LargestLogits(TorchDispatchMode):
    # The largest (rows, V) tensor any op makes in a forward + backward, in MB: with chunked CE,
    # at most ce_chunk rows of float32 logits (or their gradient), whatever the number of targets.
    # On CUDA it waits for every op, so an op that fails is the one its error names.
    def __init__(self, vocab: int, device: torch.device):
        super().__init__()
        self.vocab, self.mb, self.device = vocab, 0.0, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            raise RuntimeError(f"{func} failed: {e}") from e
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == self.vocab and not func.is_view:
                self.mb = max(self.mb, t.numel() * t.element_size() / 2**20)
        return out


def logits_mb(model, batch, name, s, autocast) -> float:
    probe = LargestLogits(model.config.vocab_size, next(model.parameters()).device)
    with probe, autocast:
        loss = loss_of(model, batch, name, s)
    with probe:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return probe.mb


def sdpa_kernels(model, batch, name, s, autocast, device) -> list[str]:
    # Which SDPA backend ran: the aten attention ops and, on CUDA, the attention kernels' names.
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with autocast:
            loss = loss_of(model, batch, name, s)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    model.zero_grad(set_to_none=True)
    keys = {e.key for e in prof.key_averages()}
    words = ("scaled_dot_product", "flash", "fmha", "efficient_attention", "cudnn", "attention")
    return sorted(k for k in keys if any(w in k.lower() for w in words))


def linear_gflop(model, batch, name: str, s: Settings) -> float:
    # The matmuls of one forward + backward as torch counts them (aten.mm and aten.addmm: the linear layers
    # and the head; attention is no part of them): the gated adapter's step, whose frozen base, low-rank
    # updates and self-distilled targets no short formula follows.
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss_of(model, batch, name, s).backward()
    model.zero_grad(set_to_none=True)
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm")) / 1e9


def matmul_gflop(c: Config, batch, s: Settings, split: bool, name: str = "", linear: float = 0.0,
                 attention: bool = True) -> float:
    # Matmul FLOPs of forward + backward (3x forward), what a GPU's time follows at scale: the
    # linear layers on every column; attention over what the kernels compute (causal SDPA skips
    # the upper triangle, a masked call computes every pair: MARS with the split attention is
    # L^2/2 for the clean queries plus (T - L) x T for the noisy ones); the head on targets, once
    # more in the backward when chunked CE recomputes it. linear: the adapter's linear GFLOP (linear_gflop).
    # attention False: the rest alone, which torch's own count of the matmuls checks (tests/product/test_gpu_check.py).
    N, T = batch.tokens.shape
    L = batch.L
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_token = 2 * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    if batch.noisy is None:
        pairs = 0.5 * L * L
    else:
        pairs = 0.5 * L * L + (T - L) * T if split else T * T
    pairs *= attention
    layers = c.num_hidden_layers * (N * T * per_token + N * 4 * pairs * q)
    head = 2 * c.hidden_size * c.vocab_size * int((batch.labels != IGNORE).sum())
    if name == "adapter":  # attention: the clean columns forward only; the noisy ones forward and backward to inputs
        clean = c.num_hidden_layers * N * 4 * 0.5 * L * L * q
        return linear + (clean + 2 * (c.num_hidden_layers * N * 4 * pairs * q - clean)) / 1e9
    return (3 * (layers + head) + (head if s.ce_chunk > 0 else 0)) / 1e9


def run(s: Settings) -> dict:
    if s.seq_len % s.block_size:
        raise SystemExit(f"--seq-len {s.seq_len} is not a multiple of --block-size {s.block_size}")
    device, compute, autocast, models, opts, batches = setup(s)
    print(json.dumps(asdict(s)), f"device={device} compute={compute} threads={torch.get_num_threads()}")

    fwd_bwd, step, peak = {n: [] for n in MODES}, {n: [] for n in MODES}, {}
    for rep in range(s.steps + 1):  # interleaved: ar, mars, mars+prune, 1-call, ar, ...
        for name, batch in batches.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            a, b = train_step(models[name], opts[name], batch, name, s, autocast, device)
            if rep > 0:  # rep 0 warms up kernels and the allocator
                fwd_bwd[name].append(a)
                step[name].append(b)
            if device.type == "cuda":
                peak[name] = torch.cuda.max_memory_allocated(device) / 2**20
    # The timings first, and in the file at once; then what each mode keeps and runs, each on its own,
    # so one that fails leaves its error in its place and the numbers before it.
    rows = {name: dict(columns=batch.tokens.shape[1], fwd_bwd_ms=1e3 * float(np.median(fwd_bwd[name])),
                       step_ms=1e3 * float(np.median(step[name])),
                       gflop=None if name == "adapter" else matmul_gflop(models[name].config, batch, s,
                                                                          MODES[name][2], name),
                       targets=int((batch.labels != IGNORE).sum()), state_mb=state_mb(models[name]),
                       **({"peak_mb": peak[name]} if peak else {}))
            for name, batch in batches.items()}
    result = {"settings": asdict(s), "device": str(device), "compute": compute, "modes": rows}
    write_json(s, result)

    def adapter_gflop(m, b, n):  # counted, a forward and backward more: a probe, after the timings are saved
        with autocast:
            linear = linear_gflop(m, b, n, s)
        return matmul_gflop(m.config, b, s, MODES[n][2], n, linear)

    probes = {"gflop": lambda m, b, n: adapter_gflop(m, b, n) if n == "adapter" else rows[n]["gflop"],
              "saved_mb": lambda m, b, n: saved_mb(m, b, n, s, autocast),
              "logits_mb": lambda m, b, n: logits_mb(m, b, n, s, autocast),
              "sdpa": lambda m, b, n: sdpa_kernels(m, b, n, s, autocast, device)}
    for name, batch in batches.items():
        for key, probe in probes.items():
            try:
                rows[name][key] = probe(models[name], batch, name)
            except RuntimeError as e:
                rows[name][key] = None
                result.setdefault("errors", {})[f"{name} {key}"] = str(e)[:2000]
                print(f"{name} {key}: {e}", flush=True)
    write_json(s, result)
    ar = rows["ar"]

    def cell(r: dict, key: str, width: int, fmt: str, ratio: bool = False) -> str:
        # A column's value (and its ratio to AR's); a dash where its probe failed.
        v = r[key]
        text = "-" if v is None else format(v, fmt)
        if ratio:
            text += " " + ("-" if v is None or not ar[key] else f"{v / ar[key]:.2f}").rjust(5)
        return text.rjust(width + (6 if ratio else 0))

    head = (f"\n{'mode':<11} {'columns':>7} {'fwd+bwd ms':>11} {'x AR':>5} {'step ms':>9} {'x AR':>5} "
            f"{'GFLOP':>7} {'x AR':>5} {'saved MB':>9} {'x AR':>5} {'targets':>7} {'logits MB':>9} {'state MB':>9}")
    print(head + (f" {'peak MB':>8} {'x AR':>5}" if peak else ""))
    for name, r in rows.items():
        line = " ".join([f"{name:<11}", cell(r, "columns", 7, "d"), cell(r, "fwd_bwd_ms", 11, ".1f", True),
                         cell(r, "step_ms", 9, ".1f", True), cell(r, "gflop", 7, ".1f", True),
                         cell(r, "saved_mb", 9, ".0f", True), cell(r, "targets", 7, "d"),
                         cell(r, "logits_mb", 9, ".1f"), cell(r, "state_mb", 9, ".0f")])
        print(line + (" " + cell(r, "peak_mb", 8, ".0f", True) if peak else ""))
    print("\nattention ops and kernels per mode:")
    for name, r in rows.items():
        print(f"  {name:<11} {', '.join(r['sdpa'] or ['-'])}")
    return result


def write_json(s: Settings, result: dict) -> None:
    if s.json:
        Path(s.json).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(s.json), json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict:
    s = cli.parse(Settings, argv, "Time and memory of a MARS step vs an AR step.")
    cli.at_least_1(s, "steps", "batch_size", "seq_len", "block_size")
    return run(s)


if __name__ == "__main__":
    main()
