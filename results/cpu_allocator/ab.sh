#!/bin/bash
# One short run of arm 7's recipe under /usr/bin/time -v, in the environment given: ab.sh NAME [VAR=VALUE ...];
# NAME.rss samples the trainer's VmHWM and VmRSS (KiB) every second.
cd /work/main
name=$1; shift
rm -rf runs/mem/$name runs/mem/$name.rss
env "$@" /usr/bin/time -v .venv/bin/python -u train.py --init /work/real/coder05 --data data/stdlib/mix.jsonl \
  --mode mars --adapter gated-lora --lora-rank 16 --mask-target self --mask-embed one --mask-init checkpoint \
  --block-size 4 --lr 1e-4 --batch-size 2 --global-batch 4 --max-len 384 --dtype bfloat16 --max-steps ${STEPS:-12} \
  --ce-chunk 128 --eval-every 1000 --save-every 1000 --keep 1 --calibrate 0 --out runs/mem/$name > runs/mem/$name.log 2>&1 &
T=$!
sleep 2
PY=$(pgrep -P $T | head -1)
while kill -0 $T 2>/dev/null; do
  echo "$(date +%s) $(grep -E 'VmHWM|VmRSS' /proc/$PY/status 2>/dev/null | awk '{print $2}' | tr '\n' ' ')" >> runs/mem/$name.rss
  sleep 1
done
