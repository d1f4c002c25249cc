#!/bin/sh
# Arm 9 (docs/real-model.md): arm 8's recipe under a 59-minute wall-clock budget (train.py --minutes), the
# cosine decaying by the clock; --max-steps 520 is only the cap that sets the warmup (16 steps).
cd /work/main && exec /usr/bin/time -v .venv/bin/python train.py --init /work/real/coder05 --data data/stdlib/mix.jsonl \
  --mode mars --adapter gated-lora --lora-rank 16 --mask-target self --mask-embed one --mask-init checkpoint \
  --block-size 4 --lr 1e-4 --batch-size 1 --global-batch 4 --max-len 384 --dtype bfloat16 --max-steps 520 \
  --minutes 59 --ce-chunk 128 --eval-every 104 --save-every 20 --keep 1 --calibrate 0 --resume --out runs/real11/arm9
