#!/bin/sh
# Arm 8 (docs/real-model.md): arm 7's recipe at --batch-size 1 (the same global batch of 4) for the full hour.
cd /work/main && exec /usr/bin/time -v .venv/bin/python train.py --init /work/real/coder05 --data data/stdlib/mix.jsonl \
  --mode mars --adapter gated-lora --lora-rank 16 --mask-target self --mask-embed one --mask-init checkpoint \
  --block-size 4 --lr 1e-4 --batch-size 1 --global-batch 4 --max-len 384 --dtype bfloat16 --max-steps ${1:-500} \
  --ce-chunk 128 --eval-every 104 --save-every 20 --keep 1 --calibrate 0 --resume --out runs/real10/arm8
