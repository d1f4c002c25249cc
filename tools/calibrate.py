# Fits a checkpoint's calibration map (calibration.py, docs/method.md §6) and saves it beside its
# weights as calibration.json, which generate.py, eval.py and serve.py then read: --threshold tau
# accepts slot i while its calibrated chance of being the greedy token is >= tau.
#
# The labels come from self-verification on held-out prompts (verify, full tree, greedy): every draft
# checked is one (slot, confidence, right) label. The prompts are --prompts FILE, or, for a run that
# train.py wrote, the held-out rows of its own --data split (the same seed and fraction).
#   python -m tools.calibrate --ckpt runs/demo/mars                     # the run's held-out split
#   python -m tools.calibrate --ckpt runs/demo/mars --prompts data/demo/test.jsonl --limit 64
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch

import train
from mars import calibration, cli
from mars.checkpoint import DEFAULT_CKPT, check_checkpoint, load_model, trained_block_size
from mars.cli import device_and_dtype
from mars.prompts import encode_prompts
from mars.tokenizer import Tokenizer

TAUS = (0.5, 0.7, 0.8, 0.9, 0.95)  # the bars printed in the summary


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # a MARS checkpoint: directory, hub id or alias
    prompts: str = ""  # JSONL prompts; empty = the held-out rows of the run's own --data (its settings.json)
    limit: int = 64  # at most this many prompts
    max_new_tokens: int = 128  # per prompt: the longer, the more labels
    batch_size: int = 8  # prompts decoded together
    block_size: int = 0  # B; 0 = the checkpoint's own
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    out: str = ""  # folder for calibration.json; empty = the checkpoint's own


def run_split(path: Path, tok: Tokenizer) -> list[list[int]]:
    # The held-out rows of the run that wrote this checkpoint, split as train.py split them.
    from mars.train_settings import Settings as TrainSettings

    file = path / "settings.json"
    if not file.is_file():
        raise ValueError(f"{path} has no settings.json, so it has no held-out split: pass --prompts FILE.jsonl")
    saved = json.loads(file.read_text())
    known = {f.name for f in fields(TrainSettings)}
    s = TrainSettings(**{k: v for k, v in saved.items() if k in known})
    env = SimpleNamespace(local_rank=0, log=lambda msg: print(msg, file=sys.stderr))
    _, held_out = train.split_data(s, tok, env)
    if not len(held_out):
        raise ValueError(f"{file}: the run held nothing out (--eval-every 0); pass --prompts FILE.jsonl")
    return calibration.prompts_of(held_out)


def summary(cal: calibration.Calibration) -> str:
    rows = ["| slot | labels | right | raw bar for tau " + " | ".join(map(str, TAUS)) + " |",
            "|---|---|---|" + "---|" * len(TAUS)]
    for kind, curves in (("", cal.curves), (" (repeats)", cal.repeats)):
        for i, c in enumerate(curves, 1):
            n = sum(c.n)
            rate = sum(p * k for p, k in zip(c.p, c.n)) / n if n else 0.0
            rows.append(f"| {i}{kind} | {n} | {rate:.2f} | " + " | ".join(f"{c.threshold(t):.3f}" for t in TAUS) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Fit a checkpoint's calibration map from self-verification on held-out prompts.")
    try:
        path, config = check_checkpoint(s.ckpt)
        B = trained_block_size(path, s.block_size)
        tok = Tokenizer.from_pretrained(path)
        if s.prompts:
            prompts = encode_prompts([], s.prompts, False, tok, s.max_new_tokens, config.max_position_embeddings)
        else:
            prompts = run_split(Path(path), tok)
        device, dtype = device_and_dtype(s.device, s.dtype)
        model = load_model(path, device, dtype)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    prompts = prompts[:s.limit]
    with torch.inference_mode():
        found, _ = train.calibration_labels(model, tok, prompts, B, s.max_new_tokens, s.batch_size,
                                             log=lambda msg: print(msg, file=sys.stderr, flush=True))
    source = f"{s.prompts or 'the held-out split of ' + str(path)}: {len(prompts)} prompts, {s.max_new_tokens} tokens"
    if not found:
        sys.exit(f"error: the {len(prompts)} prompts gave no labels (every reply ended before a draft was checked); "
                 "pass more or longer prompts")
    cal = calibration.from_labels(found, B - 1, source)
    print(summary(cal))
    print(f"wrote {calibration.save(cal, s.out or path)}", file=sys.stderr)


if __name__ == "__main__":
    main()
