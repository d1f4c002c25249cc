# t(n): the time of one cached forward that feeds n new positions per row, after a committed context,
# for R rows at once. A verify step feeds 1 + drafts + masks positions per row, so this curve says
# what a wider draft tree costs on this machine and in this dtype (docs/method.md §9, the budget).
#
#   python -m tools.forward_cost --ckpt DIR --dtypes bfloat16 float32 --out results/forward_cost.json
#   python -m tools.forward_cost --demo                 # the demo model's shape, random weights
# Each measurement is the median of --reps timed forwards after one warm-up; the models, dtypes, row
# counts and widths are measured in one run, so their ratios are side by side.
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
import torch

import cli
from checkpoint import check_checkpoint, load_model
from kvcache import KVCache
from model import DTYPES, Transformer
from tokenizer import Tokenizer


@dataclass
class Settings:
    ckpt: str = ""  # a checkpoint directory to measure (its shape and dtype matter, not its weights)
    demo: bool = False  # also measure the demo model's shape (train.tiny_config), random weights
    dtypes: list[str] = field(default_factory=lambda: ["bfloat16", "float32"])  # float32, bfloat16
    rows: list[int] = field(default_factory=lambda: [1, 8])  # R, rows fed at once
    max_width: int = 32  # n = 1..max_width new positions per row
    context: int = 256  # committed tokens per row before the measured forward
    head_positions: int = 16  # the LM head runs at min(n, this) positions per row, as a decode step reads it
    reps: int = 5  # timed forwards per point; the median is kept
    out: str = "results/forward_cost.json"  # merged into an existing file: other models' entries stay


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@torch.inference_mode()
def curve(model: Transformer, R: int, s: Settings) -> list[float]:
    # Seconds of one forward per width n = 1..max_width: n new tokens per row at positions
    # context..context+n-1, causal over the cache; nothing is committed, so every width starts alike.
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    kv = KVCache(model.config, R, s.context + s.max_width, device, dtype)
    V = min(model.config.vocab_size, 1000)
    prompt = torch.randint(0, V, (R, s.context), generator=torch.Generator().manual_seed(0))
    model.hidden(prompt, None, None, kv)
    kv.commit([s.context] * R)
    seconds = []
    for n in range(1, s.max_width + 1):
        tokens = torch.randint(0, V, (R, n), generator=torch.Generator().manual_seed(n))
        pos = s.context + torch.arange(n).expand(R, n)
        mask = (torch.arange(s.context + n) <= pos[..., None])[:, None]  # (R, 1, n, S)
        times = []
        for rep in range(s.reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            h = model.hidden(tokens, pos, mask, kv)
            model.head(h[:, :s.head_positions])
            times.append(time.perf_counter() - t0)
        seconds.append(statistics.median(times[1:]))
    return seconds


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "The time of one cached forward against the positions it feeds.")
    if not s.ckpt and not s.demo:
        sys.exit("error: nothing to measure; pass --ckpt DIR and/or --demo")
    bad = [d for d in s.dtypes if d not in ("float32", "bfloat16")]
    if bad:
        sys.exit(f"error: --dtypes {' '.join(bad)}: choose float32 and/or bfloat16")
    models = {}
    if s.ckpt:
        path, _ = check_checkpoint(s.ckpt)
        models[Path(path).name] = lambda dtype: load_model(path, "cpu", dtype)
    if s.demo:
        from train import tiny_config

        config = tiny_config(Tokenizer.byte_level())
        models["demo"] = lambda dtype: Transformer(config).to(dtype)
    out = Path(s.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    report.update({"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "settings": asdict(s)})
    report.setdefault("models", {})
    for name, build in models.items():
        for dtype_name in s.dtypes:
            model = build(DTYPES[dtype_name]).eval()
            for R in s.rows:
                t = curve(model, R, s)
                report["models"].setdefault(name, {}).setdefault(dtype_name, {})[str(R)] = {
                    "n": list(range(1, s.max_width + 1)), "seconds": t}
                print(f"{name} {dtype_name} R={R}: t(1) {t[0] * 1000:.1f} ms | t(n)/t(1) at n = 4, 8, 16, 32: "
                      + ", ".join(f"{t[n - 1] / t[0]:.2f}" for n in (4, 8, 16, 32) if n <= s.max_width),
                      file=sys.stderr, flush=True)
            del model
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
