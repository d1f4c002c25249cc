#!/bin/sh
# Arm 7 (docs/real-model.md): arm 6's recipe at --ce-chunk 128 for the full hour, 460 steps.
cd /work/main && exec /usr/bin/time -v .venv/bin/python train.py --init /work/real/coder05 --data data/stdlib/mix.jsonl \
  --mode mars --adapter gated-lora --lora-rank 16 --mask-target self --mask-embed one --mask-init checkpoint \
  --block-size 4 --lr 1e-4 --batch-size 2 --global-batch 4 --max-len 384 --dtype bfloat16 --max-steps ${1:-460} \
  --ce-chunk 128 --eval-every 92 --save-every 20 --keep 1 --calibrate 0 --resume --out runs/real9/arm7
