#!/bin/sh
# Arm 4's evaluations (docs/real-model.md): batch 1 side by side first (on an idle machine), then all 164, then float32.
cd /work/main
.venv/bin/python eval.py --ckpt runs/real5/arm4 --task humaneval --limit 8 --modes ar verify verify-tree \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out runs/real5/arm4-b1.json > runs/real5/arm4-b1.log 2>&1
.venv/bin/python runs/real5/hooks.py > runs/real5/hooks.log 2>&1
.venv/bin/python eval.py --ckpt runs/real5/arm4 --task humaneval --modes verify --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline runs/real5/base.json --out runs/real5/arm4.json --resume > runs/real5/arm4-164.log 2>&1
.venv/bin/python eval.py --ckpt runs/real5/arm4 --task humaneval --limit 16 --modes ar verify --batch-size 8 \
  --dtype float32 --max-new-tokens 512 --out runs/real5/arm4-fp32.json --resume > runs/real5/arm4-fp32.log 2>&1
