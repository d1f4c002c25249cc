#!/bin/sh
# Arm 1's recipe (docs/real-model.md) in float32 (this CPU has no bf16 matmuls), for $1 steps: a speed check, not an arm.
cd /work/main && exec /usr/bin/time -v .venv/bin/python train.py --init /work/real/coder05 --data data/stdlib/mix.jsonl \
  --mode mars --adapter gated-lora --lora-rank 16 --mask-target self --mask-embed one --mask-init checkpoint \
  --block-size 4 --lr 1e-4 --batch-size 2 --global-batch 4 --max-len 384 --dtype float32 --max-steps $1 \
  --eval-every 0 --save-every 10 --keep 1 --calibrate 0 --resume --out runs/speed/adapter
