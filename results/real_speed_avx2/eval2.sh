#!/bin/sh
# Batch 1, the first 8 HumanEval problems, side by side: AR, verify at this machine's budget (3), the full tree.
cd /work/main && exec .venv/bin/python eval.py --ckpt runs/speed/adapter --task humaneval --limit 8 \
  --modes ar verify-3 --batch-size 1 --dtype float32 --max-new-tokens 512 --out runs/speed/b1-onehead.json
