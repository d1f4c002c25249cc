#!/bin/bash
# Arm 8's recipe at --batch-size 1 against arm 7's --batch-size 2 (the same global batch of 4), 20 steps each,
# in the order 2, 1, 1, 2, from the same start and data order; peak RSS and wall clock by /usr/bin/time -v.
cd /work/main
R=runs/real10/bs_ab
mkdir -p $R
run() { rm -rf $R/bs$1-$2; /usr/bin/time -v .venv/bin/python train.py --init /work/real/coder05 --data data/stdlib/mix.jsonl \
  --mode mars --adapter gated-lora --lora-rank 16 --mask-target self --mask-embed one --mask-init checkpoint \
  --block-size 4 --lr 1e-4 --batch-size $1 --global-batch 4 --max-len 384 --dtype bfloat16 --max-steps 20 \
  --ce-chunk 128 --eval-every 0 --save-every 0 --keep 1 --calibrate 0 --quiet --out $R/bs$1-$2 > $R/bs$1-$2.log 2>&1; }
run 2 a; run 1 a; run 1 b; run 2 b
