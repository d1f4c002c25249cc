# The settings of train.py, one dataclass that becomes its flags (cli.py), and their checks: everything
# the flags alone show to be wrong fails here, before any file is read. The resolved settings are printed
# and saved with every checkpoint (settings.json).
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

from mars import cli
from mars.cli import device_and_dtype
from mars.layout import MAX_BLOCK_SIZE


@dataclass
class Settings:
    init: str = "tiny"  # tiny (random, byte-level), qwen2.5-0.5b, qwen2.5-7b, a hub id or a checkpoint dir
    data: str = ""  # chat .jsonl/.json/.parquet file or folder, or a hub dataset id; required unless --init tiny
    mode: Literal["ar", "mars"] = "mars"  # ar: plain SFT (stage 1); mars: clean + noisy streams (stage 2)
    block_size: int = 4  # B: tokens predicted per block (docs/method.md §3); paper 4, also 8 and 16
    ar_weight: float = 1.0  # loss = loss_mask + ar_weight * loss_ar (docs/method.md §4)
    prune: bool = True  # drop dead noisy blocks (no supervised target): same loss, less compute
    max_len: int = 512  # keep the first max_len tokens (rounded down to a multiple of B)
    last_turn_only: bool = False  # supervise only the last assistant turn (the paper's code)
    batch_size: int = 16  # sequences per micro-batch, per process
    global_batch: int = 384  # sequences per optimizer step, all processes (docs/method.md §5); sets grad accumulation
    ce_chunk: int = 2048  # supervised targets per LM-head + cross-entropy chunk (bounds logits memory); 0 = all at once
    lr: float = -1.0  # peak lr; -1 = 5e-6 for checkpoints (docs/method.md §5), 1e-4 for an adapter, 1e-3 for tiny
    warmup: float = 0.03  # fraction of the steps spent in linear warmup, then cosine decay to 0
    weight_decay: float = 0.0  # AdamW decay of weight matrices (never norms, biases, embeddings)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    epochs: int = 5  # passes over the training data (docs/method.md §5), unless max_steps is set
    max_steps: int = 0  # optimizer steps to run; 0 = as many as epochs take
    minutes: float = 0.0  # a wall-clock budget: the lr decays by the clock and the run ends in time; 0 = none
    eval_data: str = ""  # held-out chat file; empty = hold out eval_fraction of --data
    eval_fraction: float = 0.01  # about this share of --data held out (by prompt) for the eval loss; no --eval-data
    eval_max: int = 1000  # at most this many held-out examples (the eval loss is a full pass)
    eval_every: int = 200  # steps between eval losses (also before step 1 and after the last); 0 = never
    save_every: int = 500  # steps between checkpoints in OUT/checkpoints, and one at the end; 0 = the model alone
    # (a run --minutes stops still writes one, to go on from)
    keep: int = 2  # keep the newest K checkpoints
    out: str = "runs/mars"  # final model, metrics.jsonl and checkpoints/ go here
    resume: bool = False  # continue the run in --out from its newest checkpoint
    log_every: int = 0  # keep every Nth step's line on the screen (metrics.jsonl has every step); 0 = 20 lines a run
    quiet: bool = False  # print no settings, model or data summary: only steps, evals, saves and warnings
    mask_init: Literal["checkpoint", "mean"] = "checkpoint"  # <|mask|> row (adapter: offset): as saved, or the mean
    seed: int = 42  # data order and the tiny model's weights
    device: str = "auto"  # auto (cuda when present), cpu, cuda; torchrun gives each process its GPU
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # compute dtype (bfloat16 = autocast); auto: bf16 on CUDA
    compile: bool = False  # torch.compile the blocks and the LM head + loss, for dynamic shapes (not with --adapter)
    fsdp: bool = False  # shard weights, gradients and AdamW state over the processes (FSDP2; run under torchrun)
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # saved weights; auto: the init's dtype
    mask_target: Literal["data", "self"] = "data"  # noisy targets: the data's tokens, or the model's own distribution
    adapter: Literal["none", "gated-lora"] = "none"  # gated-lora: frozen base, low-rank updates at mask positions
    lora_rank: int = 16  # the adapter's rank
    lora_alpha: float = 32.0  # the adapter's updates are scaled by lora_alpha / lora_rank


def check_settings(s: Settings) -> None:
    # Everything the flags alone show to be wrong, before any file is read (a usage error, exit 2).
    for name in ("block_size", "batch_size", "global_batch", "keep", "lora_rank"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    for name in ("max_steps", "epochs", "eval_every", "save_every", "eval_max", "log_every"):
        if getattr(s, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 0")
    if s.max_steps == 0 and s.epochs == 0:
        raise ValueError("--epochs 0 with --max-steps 0 trains nothing; give --epochs N or --max-steps N")
    if not 0 <= s.minutes < math.inf:
        raise ValueError(f"--minutes {s.minutes} must be a number >= 0 (0: no time budget)")
    if s.block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size {s.block_size}: at most {MAX_BLOCK_SIZE}, the most the decoding scripts take "
                         "(a verify step's full tree feeds B^2 positions a row)")
    if s.max_len < s.block_size:
        raise ValueError(f"--max-len {s.max_len} is shorter than one block (--block-size {s.block_size})")
    if not (s.lr == -1 or 0 <= s.lr < math.inf):
        raise ValueError(f"--lr {s.lr} must be >= 0 (or -1 for the default)")
    for name in ("ar_weight", "weight_decay"):
        if not 0 <= getattr(s, name) < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be a number >= 0")
    if s.adapter != "none" and s.mode != "mars":
        raise ValueError(f"--adapter {s.adapter} trains the mask slots: it needs --mode mars")
    if s.adapter != "none" and s.fsdp:
        raise ValueError("--adapter with --fsdp is not supported: the frozen base is small enough to replicate")
    if s.adapter != "none" and s.compile:
        raise ValueError("--compile with --adapter is not supported: the adapter's hooks differ from block to "
                         "block, so every block would compile on its own, and past torch's limit of 8 compiles the "
                         "run goes on eager; drop --compile")
    if s.adapter != "none" and s.init == "tiny":
        raise ValueError("--adapter trains on a frozen base it names by its folder, and --init tiny is built in "
                         "memory: its adapter could never be loaded again; give --init a checkpoint directory")
    if s.mode == "ar" and s.mask_target != "data":
        raise ValueError("--mask-target self sets the noisy stream's targets: it needs --mode mars")
    if s.adapter != "none" and not 0 < s.lora_alpha < math.inf:  # saved, it would not load (adapter.read_config)
        raise ValueError(f"--lora-alpha {s.lora_alpha} must be a number > 0")
    if not s.grad_clip > 0:
        raise ValueError(f"--grad-clip {s.grad_clip} must be > 0")
    for name in ("warmup", "eval_fraction"):
        if not 0 <= getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be in [0, 1)")
    check_global_batch(s.global_batch, s.batch_size, int(os.environ.get("WORLD_SIZE", 1)))  # torchrun's processes
    if not s.data and s.init != "tiny":  # a real model trained on the byte-level demo data by default would be a trap
        raise ValueError(f"--init {s.init} needs --data: a chat .jsonl/.json/.parquet file or folder, or a hub "
                         "dataset id such as allenai/Dolci-Instruct-SFT (the paper's data)")
    if Path(s.out).exists() and not Path(s.out).is_dir():
        raise ValueError(f"--out {s.out} is a file: the run writes a folder there; choose another --out")
    if s.init != "tiny" and Path(s.init).is_dir() and Path(s.out).is_dir() and os.path.samefile(s.init, s.out):
        raise ValueError(f"--init and --out are both {s.out}: a run starts from --init and saves to --out, which "
                         "would overwrite it; give the new run (stage 2, say) another --out")
    device_and_dtype(s.device, s.dtype)


def check_global_batch(global_batch: int, batch_size: int, world: int) -> None:
    # A ValueError where the global batch is not whole micro-batches of every process, naming what would fit.
    per_round = batch_size * world
    if global_batch % per_round:
        fits = [b for b in range(batch_size, 0, -1) if global_batch % (b * world) == 0][:3]
        instead = f"use --batch-size {' or '.join(map(str, fits))}, or " if fits else "use "
        raise ValueError(f"--global-batch {global_batch} is not a multiple of --batch-size {batch_size} x "
                         f"{world} processes = {per_round}; {instead}a --global-batch that is a multiple of "
                         f"{per_round}" + ("" if fits else f" (no batch size divides {global_batch} over {world} "
                                                           "processes)"))


DEMO_DATA = "data/demo/train.jsonl"  # --init tiny's data when --data is not given: `make demo` writes it

# Flags of the decoding scripts that train.py refuses by name, saying why, rather than as unknown flags.
DECODING_ONLY = {"--quantize": "quantization is for decoding (generate.py, serve.py, eval.py); training needs float "
                               "weights: drop the flag"}


def run_settings(out: Path) -> dict:
    # The settings of the run in `out` as its newest checkpoint saved them, less those of this machine and
    # place (--device, --out, --resume, and --fsdp outside torchrun: a sharded run goes on in one process);
    # {} where there is none to read (checkpoint.restore says why).
    from mars.checkpoint import checkpoints

    found = checkpoints(out)
    try:
        saved = json.loads((found[-1] / "settings.json").read_text()) if found else {}
    except (OSError, ValueError):
        return {}
    here = {"device", "out", "resume"} | (set() if "RANK" in os.environ else {"fsdp"})  # RANK: under torchrun
    names = {f.name for f in fields(Settings)} - here
    if isinstance(saved, dict) and saved.get("fsdp") and "fsdp" in here:
        print(f"note: {out} trained with --fsdp under torchrun; it goes on in this one process (its whole model on "
              "one device)", file=sys.stderr)
    return {k: v for k, v in saved.items() if k in names} if isinstance(saved, dict) else {}


def parse_settings(argv: list[str] | None = None) -> Settings:
    for arg in sys.argv[1:] if argv is None else argv:
        if (flag := arg.split("=")[0]) in DECODING_ONLY:  # a usage error, as cli.parse's: one line, status 2
            print(f"train.py: error: {flag}: {DECODING_ONLY[flag]}", file=sys.stderr)
            raise SystemExit(2)
    about = "AR SFT or MARS fine-tuning (docs/method.md §1-5)."
    first = cli.parse(Settings, argv, about)
    # --resume: a flag not given takes the run's own value (its newest checkpoint's settings.json), so that a
    # run resumed without its --init or --lr goes on as it started; one given is checked against it on restore
    s = cli.parse(Settings, argv, about, defaults=run_settings(Path(first.out)) if first.resume else None,
                  check=check_settings)
    if s.lr < 0:  # paper lr for real checkpoints; a random tiny model needs a much larger one
        s = replace(s, lr=1e-3 if s.init == "tiny" else 1e-4 if s.adapter != "none" else 5e-6)
    if not s.data:  # --init tiny's own data (check_settings refused a real model without --data)
        s = replace(s, data=DEMO_DATA)
    return s
