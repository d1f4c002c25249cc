# Are the MARS slots calibrated? Teacher-forced on reference answers: for every answer position c,
# forward [prompt + answer[:c] + B masks] and score slot i's candidate against answer[c + i], bucketed
# by its confidence. A slot accepted at tau should be right at least a tau share of the time.
#   python -m tools.calibrate --ckpt runs/demo/mars --data data/demo --examples 100
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import cli
from checkpoint import DEFAULT_CKPT
from generate import allowed
from hub import resolve_checkpoint
from model import Transformer
from tokenizer import Tokenizer

BUCKETS = ((0.9, ">= 0.9"), (0.7, "0.7-0.9"), (0.0, "< 0.7"))


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # a MARS checkpoint: directory, hub id or alias
    data: str = "data/demo"  # folder with test.jsonl and train.jsonl ({"messages": [...]} rows)
    examples: int = 100  # first N examples of each split
    block_size: int = 4  # B, the window


@torch.inference_mode()
def calibration(model: Transformer, tok: Tokenizer, rows: list[dict], B: int) -> dict:
    stats: dict[tuple[int, str], list[int]] = {}  # (slot, bucket) -> [right, total]
    for r in rows:
        prompt = tok.encode_chat(r["messages"][:-1], add_generation_prompt=True)
        answer = tok.encode_chat(r["messages"])[len(prompt):]
        xs = [prompt + answer[:c] + [tok.mask_id] * B for c in range(len(answer) - B)]
        T = max(map(len, xs))
        logits = model(torch.tensor([x + [tok.mask_id] * (T - len(x)) for x in xs]))  # (N, T, V)
        for k, x in enumerate(xs):
            c = len(x) - B  # slot i reads position c + i - 1 (§6)
            conf, cand = allowed(logits[k, c - 1:c + B - 1], tok.mask_id, tok.vocab_size).float().softmax(-1).max(-1)
            for i in range(B):
                bucket = next(name for lo, name in BUCKETS if conf[i] >= lo)
                s = stats.setdefault((i, bucket), [0, 0])
                s[0] += int(cand[i] == answer[c - len(prompt) + i])
                s[1] += 1
    return stats


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Calibration of the MARS slots, teacher-forced.")
    try:
        path = resolve_checkpoint(s.ckpt)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    tok = Tokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, dtype=torch.float32).eval()
    print("| split | slot | confidence | right | of |")
    print("|---|---|---|---|---|")
    for split in ("test", "train"):
        lines = (Path(s.data) / f"{split}.jsonl").read_text().splitlines()[:s.examples]
        stats = calibration(model, tok, [json.loads(line) for line in lines], s.block_size)
        for (slot, bucket), (right, n) in sorted(stats.items()):
            print(f"| {split} | {slot} | {bucket} | {100 * right / n:.1f}% | {n} |")


if __name__ == "__main__":
    main()
