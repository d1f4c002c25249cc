# t(n): the time of one cached forward that feeds n new positions per row, after a committed context,
# for R rows at once. A verify step feeds 1 + drafts + masks positions per row, so this curve says
# what a wider draft tree costs on this machine and in this dtype (docs/method.md §9, the budget).
#
#   python -m tools.forward_cost --ckpt DIR --dtypes bfloat16 float32 --out results/forward_cost.json
#   python -m tools.forward_cost --demo                 # the demo model's shape, random weights
#   python -m tools.forward_cost --ckpt DIR --dtypes bfloat16 --rows 1 --head-rows 1 4 13 32 64 96 128
#   python -m tools.forward_cost --ckpt DIR --dtypes bfloat16 --quantize none int8 int4 --widths 1 4 16 64
#   python -m tools.forward_cost --ckpt ADAPTER_RUN --dtypes bfloat16 --quantize int4 --adapter-matmuls-too
#   python -m tools.forward_cost --choose MODEL --block-size 8 --acceptance 0.73 0.56 0.44
#   python -m tools.forward_cost --ckpt DIR --drift-only --dtypes float32 bfloat16 --widths 1 2 4 8 16
# --choose reads the measured curve and prints the --draft-budget that maximises expected tokens per
# second at each row count: the budget rule (layout.budget_layout) run to its steady state, with draft i
# accepted with the given chance once drafts 1..i-1 are (the last value repeats for later drafts).
# Each measurement is the median of --reps timed forwards after one warm-up; the models, dtypes, row
# counts and widths are measured in one run, so their ratios are side by side. Beside each time, the bytes
# that forward allocates: with the cache read as stored, they grow with the width, not with --context.
# And how far one position's logits move with the width of the forward that computes them (logit_drift):
# verify feeds several positions where AR feeds one, so its reply parts from AR's only where the top two
# logits lie closer than that (docs/method.md §9).
from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvcache import KVCache
from mars import budget, cli, cpu_kernels, quantize
from mars.checkpoint import check_checkpoint, load_model
from mars.cpu import FEW_ROWS, use_few_rows
from mars.files import write_atomic
from mars.tokenizer import Tokenizer
from model import DTYPES, Transformer


@dataclass
class Settings:
    ckpt: str = ""  # a checkpoint directory to measure (its shape and dtype matter, not its weights)
    demo: bool = False  # also measure the demo model's shape (checkpoint.tiny_config), random weights
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16", "float32"])  # float32, bfloat16
    quantize: list[str] = field(default_factory=lambda: ["none"])  # --ckpt's weights: none or quantize.KINDS
    rows: list[int] = field(default_factory=lambda: [1, 8])  # R, rows fed at once
    widths: list[int] = field(default_factory=lambda: list(range(1, 33)) + [40, 48, 56, 64])  # n per row
    context: int = 256  # committed tokens per row before the measured forward
    head_positions: int = 16  # the LM head runs at min(n, this) positions per row, as a decode step reads it
    reps: int = 5  # timed forwards per point; the median is kept
    head_rows: list[int] = field(default_factory=list)  # also time the LM head alone at these row counts
    f_linear_too: bool = False  # also time each curve with model.py's linears (not mars.cpu.use_few_rows'), beside it
    adapter_matmuls_too: bool = False  # a bf16 gated adapter: also time each curve with its float32 matmuls
    # (MaskAdapter.updates) instead of mars/cpu_kernels.cpp's low-rank update (mars.cpu.use_lowrank_kernel)
    out: str = "results/forward_cost.json"  # merged into an existing file: other models' entries stay
    choose: str = ""  # a model measured in --out: choose the --draft-budget from its curve (nothing is timed)
    choose_dtype: str = "bfloat16"  # the curve --choose reads
    block_size: int = 8  # --choose: B, so a whole mask group is B - 1 masks
    acceptance: list[float] = field(default_factory=lambda: [0.73, 0.56, 0.44])  # --choose: per draft
    drift_only: bool = False  # measure only logit_drift (no timing), kept in --out beside the curves


def cpuinfo() -> list[str]:
    return Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []


def cpu_name() -> str:
    # The model name and the vector extensions torch uses, with bf16 matmul instructions where there are
    # any: two "AMD EPYC" machines can differ 10x in bf16 speed.
    lines = cpuinfo()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 platform.processor() or platform.machine())
    return f"{model} ({torch.backends.cpu.get_cpu_capability()}{', bf16 matmuls' if fast_bf16(lines) else ''})"


def fast_bf16(lines: list[str] | None = None) -> bool:
    # Whether this CPU has bf16 matmul instructions (AMX or AVX-512 BF16). Without them torch's bf16
    # matmuls fall back to slow kernels: on an AVX2 EPYC a bf16 matmul of training shape ran 7 to 150
    # times slower than float32's. lines: /proc/cpuinfo's, when already read.
    flags = next((line.split(":", 1)[1].split() for line in lines or cpuinfo() if line.startswith("flags")), [])
    return "amx_bf16" in flags or "avx512_bf16" in flags


def from_one(widths: list[int]) -> bool:  # rising widths from 1: t(1) is every ratio's base
    return widths[0] == 1 and all(a < b for a, b in zip(widths, widths[1:]))


def choose(s: Settings) -> None:
    report = json.loads(Path(s.out).read_text())
    curves = report.get("models", {}).get(s.choose, {}).get(s.choose_dtype)
    if curves is None:
        sys.exit(f"error: --choose {s.choose} --choose-dtype {s.choose_dtype}: no such curve in {s.out} (it has "
                 f"{', '.join(report.get('models', {})) or 'none'}); measure it first")
    for R, c in curves.items():
        if not from_one(c["n"]):
            sys.exit(f"error: {s.out}: the curve of {s.choose} {s.choose_dtype} at {R} rows was measured at widths "
                     f"{c['n']}; measure it again from width 1 (--widths 1 2 4 ...)")
    G = s.block_size - 1
    report.setdefault("budget", {}).setdefault(s.choose, {}).setdefault(s.choose_dtype, {})[f"B={s.block_size}"] = \
        chosen = {"acceptance": s.acceptance, "rows": {}}
    for R, c in curves.items():
        seconds = c["seconds"]
        t = lambda n, c=c: budget.interpolate(c["n"], c["seconds"], n)  # noqa: E731
        best, (tok, pos, speed) = budget.best_budget(s.acceptance, G, t)
        full = budget.steady_state(s.acceptance, G, 0, t)
        chosen["rows"][R] = {"budget": best, "tokens_per_forward": tok, "positions": pos,
                             "full_tree": {"tokens_per_forward": full[0], "positions": full[1],
                                           "speedup_vs_ar": full[2] * seconds[0]},
                             "speedup_vs_ar": speed * seconds[0]}
        print(f"R={R}: --draft-budget {best}: {tok:.2f} tokens/forward, {pos:.1f} positions, "
              f"{speed * seconds[0]:.2f}x AR expected; full tree {full[0]:.2f} tokens/forward, "
              f"{full[1]:.1f} positions, {full[2] * seconds[0]:.2f}x", file=sys.stderr)
    write_atomic(Path(s.out), json.dumps(report, indent=1) + "\n")


def head_seconds(model: Transformer, rows: list[int], reps: int) -> list[float]:
    # Seconds of one LM head call per row count: the median of reps calls after one warm-up. A verify
    # step calls it once or twice (verify.verify_rows), and each call reads the whole (V, C) weight.
    w = model.model.embed_tokens.weight
    out = []
    with torch.inference_mode():
        for n in rows:
            h = torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(n)).to(w)
            out.append(budget.median_seconds(lambda h=h: model.head(h), reps, w.device))
    return out


class Allocations(TorchDispatchMode):
    # Counts the bytes of the tensors that the ops run under it create: outputs that share no storage with
    # an input (views and in-place writes, as the cache's, create none). A kernel's own scratch is not seen.
    def __init__(self):
        super().__init__()
        self.bytes = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@torch.inference_mode()
def step_bytes(model: Transformer, R: int, n: int, context: int, head_positions: int = 16) -> Allocations:
    # What one forward of budget.measure's allocates: R rows, n new positions each after `context` committed
    # ones, causal over the cache, the LM head at min(n, head_positions) positions per row.
    device = model.model.embed_tokens.weight.device
    kv = KVCache(model.config, R, context + n, device, model.model.embed_tokens.weight.dtype)
    kv.commit([context] * R)  # the cached keys' values do not change what is allocated
    tokens = torch.zeros(R, n, dtype=torch.long, device=device)
    pos = context + torch.arange(n, device=device).expand(R, n)
    mask = (torch.arange(context + n, device=device) <= pos[..., None])[:, None]  # (R, 1, n, S)
    with Allocations() as counted:
        model.head(model.hidden(tokens, pos, mask, kv)[:, :head_positions])
    return counted


@torch.inference_mode()
def logit_drift(model: Transformer, widths: list[int], context: int) -> dict:
    # One position's logits from a width-n cached forward (the position first, then n - 1 more) against the
    # same position fed alone, after `context` committed tokens of random ids: the largest |difference| per
    # n, beside the logits' largest |value| and the gap between the top two at that position.
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, context + max(widths)), generator=g).to(device)
    kv = KVCache(model.config, 1, context + max(widths), device, dtype)

    def forward(start: int, n: int) -> torch.Tensor:  # the logits of positions start .. start + n - 1, float32
        pos = start + torch.arange(n, device=device)[None]
        mask = (torch.arange(start + n, device=device) <= pos[..., None])[:, None]  # (1, 1, n, start + n)
        kv.set_lengths([start])
        return model(ids[:, start:start + n], pos, mask, kv)[0].float()

    forward(0, context)
    alone = forward(context, 1)[0]
    top = alone.topk(2).values
    return {"n": widths, "max_abs_difference": [(forward(context, n)[0] - alone).abs().max().item() for n in widths],
            "largest_logit": alone.abs().max().item(), "top_two_gap": (top[0] - top[1]).item(), "context": context}


def write_report(out: Path, report: dict) -> None:  # the models measured before stay: written atomically
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def drift_only(s: Settings, models: dict, report: dict, run: dict, out: Path) -> None:
    # --drift-only: logit_drift per model and dtype, into report["logit_drift"]; the curves stay as they are.
    for name, (build, _) in models.items():
        for dtype_name in s.dtypes:
            drift = logit_drift(build(DTYPES[dtype_name]).eval(), s.widths, s.context)
            report.setdefault("logit_drift", {}).setdefault(name, {})[dtype_name] = {**drift, "measured_with": run}
            moved = ", ".join(f"{d:.1e} (n={n})" for n, d in zip(s.widths, drift["max_abs_difference"]))
            print(f"{name} {dtype_name}: logits up to {drift['largest_logit']:.1f}, the top two "
                  f"{drift['top_two_gap']:.3f} apart; moved with the width by at most {moved}", file=sys.stderr)
    write_report(out, report)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "The time of one cached forward against the positions it feeds.")
    for name in ("rows", "widths", "head_rows"):
        if any(n < 1 for n in getattr(s, name)) or (name != "head_rows" and not getattr(s, name)):
            sys.exit(f"error: --{name.replace('_', '-')}: give numbers of at least 1")
    if s.reps < 1 or s.context < 0 or s.head_positions < 1:
        sys.exit("error: --reps and --head-positions must be at least 1, --context at least 0")
    if not from_one(s.widths):
        sys.exit(f"error: --widths {' '.join(map(str, s.widths))}: give rising widths from 1, such as 1 2 4 8 16")
    if not all(0 <= a <= 1 for a in s.acceptance) or not s.acceptance or s.block_size < 2:
        sys.exit("error: --acceptance takes chances in [0, 1], --block-size at least 2")
    cli.output_file(s.out, "--out")  # found now, not after every measurement
    if s.choose:
        if not Path(s.out).is_file():
            sys.exit(f"error: --choose reads the curves in --out {s.out}, which is not there; measure first")
        return choose(s)
    if not s.ckpt and not s.demo:
        sys.exit("error: nothing to measure; pass --ckpt DIR and/or --demo")
    bad = [d for d in s.dtypes if d not in ("float32", "bfloat16")]
    if bad:
        sys.exit(f"error: --dtypes {' '.join(bad)}: choose float32 and/or bfloat16")
    try:  # an unknown kind, or one this machine has no kernel for: one line, before loading a model
        for q in s.quantize:
            for d in s.dtypes:
                quantize.check(q, "cpu", DTYPES[d])
    except ValueError as e:
        sys.exit(f"error: {e}")
    models = {}
    if s.ckpt:
        try:
            path, _ = check_checkpoint(s.ckpt)
        except (ValueError, OSError) as e:
            sys.exit(f"error: {e}")
        for q in s.quantize:  # a quantized model keeps its own linears and head: no few-rows swap (mars/cpu.py)
            name = Path(path).name + ("" if q == "none" else f" {q}")
            models[name] = (lambda dtype, q=q: load_model(path, "cpu", dtype, quantize=q)), q != "none"
    if s.demo:
        from mars.checkpoint import tiny_config

        config = tiny_config(Tokenizer.byte_level())
        models["demo"] = (lambda dtype: use_few_rows(Transformer(config).to(dtype))), False  # as load_model leaves it
    out = Path(s.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    run = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "cpu_kernels": cpu_kernels.loaded_build(), "settings": asdict(s)}
    if s.drift_only:
        return drift_only(s, models, report, run, out)
    report.update(run)  # the latest run's; each model's own run is in measured_with
    report.setdefault("models", {})
    for name, (build, quantized) in models.items():
        report.setdefault("measured_with", {})[name] = run  # a merged file's other models keep their own
        report.get("budget", {}).pop(name, None)  # chosen from the curves this run replaces
        for dtype_name in s.dtypes:
            model = build(DTYPES[dtype_name]).eval()
            for R in s.rows:
                curve = report["models"].setdefault(name, {}).setdefault(dtype_name, {})[str(R)] = {"n": s.widths}
                curve["bytes"] = [step_bytes(model, R, n, s.context, s.head_positions).bytes for n in s.widths]
                print(f"{name} {dtype_name} R={R}: allocated per forward " + ", ".join(
                      f"n={n} {b / 2**20:.2f} MiB" for n, b in zip(s.widths, curve["bytes"]) if n in (1, 4, 16, 64)),
                      file=sys.stderr, flush=True)
                for key, rows in (("seconds", FEW_ROWS), ("seconds_f_linear", 0))[:2 if s.f_linear_too else 1]:
                    if not quantized:
                        use_few_rows(model, rows)  # 0: model.py's plain linears (the same code but in CPU float32)
                    curve[key] = t = budget.measure(model, R, s.widths, s.context, s.reps, s.head_positions)
                    at = dict(zip(s.widths, t))
                    print(f"{name} {dtype_name} R={R}{' F.linear' if key != 'seconds' else ''}: t(1) "
                          f"{t[0] * 1000:.1f} ms | t(n)/t(1) at n = 4, 8, 16, 32, 64: "
                          + ", ".join(f"{at[n] / t[0]:.2f}" for n in (4, 8, 16, 32, 64) if n in at),
                          file=sys.stderr, flush=True)
                if not quantized:
                    use_few_rows(model)
                adapter = getattr(model, "adapter", None)
                if s.adapter_matmuls_too and adapter is not None and adapter.lowrank is not None:
                    kernel, adapter.lowrank = adapter.lowrank, None
                    curve["seconds_adapter_matmuls"] = t = budget.measure(model, R, s.widths, s.context, s.reps,
                                                                          s.head_positions)
                    adapter.lowrank = kernel
                    print(f"{name} {dtype_name} R={R} adapter matmuls: " + ", ".join(
                          f"t({n}) {x * 1000:.1f} ms" for n, x in zip(s.widths, t) if n <= 4),
                          file=sys.stderr, flush=True)
            if s.head_rows:
                t = head_seconds(model, s.head_rows, s.reps)
                report.setdefault("head", {}).setdefault(name, {})[dtype_name] = {"rows": s.head_rows, "seconds": t}
                print(f"{name} {dtype_name} LM head: " + ", ".join(f"{n} rows {x * 1000:.1f} ms"
                      for n, x in zip(s.head_rows, t)), file=sys.stderr, flush=True)
            del model
    write_report(out, report)


if __name__ == "__main__":
    main()
