#!/bin/bash
# After an arm's training (docs/real-model.md): results/after.sh ARM RUNS evaluates the adapter RUNS/ARM:
# its cost curve at batch 1; batch 1 on the first 8 HumanEval problems (ar, verify at the default budget,
# the full tree, side by side); all 164 in verify at the default budget (bf16, batch 8) paired with the
# base; the first 16 in float32, ar and verify, token for token; then the base's curve. One job at a
# time; a rerun skips a curve once it is written and resumes each evaluation from its decoded replies.
# Needs bubblewrap (eval.py's sandbox), /work/real/coder05 (../shared/tools/real-model), and in RUNS:
# base.json (results/real.json's base entry) and base.samples.jsonl (results/real_samples/base.jsonl with
# task_id renamed id).
set -e
ARM=$1 RUNS=$2
cd /work/main  # RUNS is relative to the checkout
[ -n "$ARM" ] && [ -d "$RUNS/$ARM" ] || { echo "usage: results/after.sh ARM RUNS (RUNS/ARM: the adapter)" >&2; exit 2; }
PY=.venv/bin/python
step() { echo "$1 start $(date +%T)" >> "$RUNS/progress.txt"; }
measured() { $PY -c "import json, sys; sys.exit('$1' not in json.load(open('$RUNS/forward_cost.json'))['models'])" 2>/dev/null; }
step curve
measured "$ARM" || $PY -m tools.forward_cost --ckpt "$RUNS/$ARM" \
  --dtypes bfloat16 --rows 1 --reps 3 --out "$RUNS/forward_cost.json" > "$RUNS/curve.log" 2>&1
step b1
$PY eval.py --ckpt "$RUNS/$ARM" --task humaneval --limit 8 --modes ar verify verify-tree --batch-size 1 \
  --dtype bfloat16 --max-new-tokens 512 --out "$RUNS/$ARM-b1.json" > "$RUNS/$ARM-b1.log" 2>&1
step 164
$PY eval.py --ckpt "$RUNS/$ARM" --task humaneval --modes verify --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline "$RUNS/base.json" --out "$RUNS/$ARM.json" --resume > "$RUNS/$ARM-164.log" 2>&1
step fp32
$PY eval.py --ckpt "$RUNS/$ARM" --task humaneval --limit 16 --modes ar verify --batch-size 8 \
  --dtype float32 --max-new-tokens 512 --out "$RUNS/$ARM-fp32.json" --resume > "$RUNS/$ARM-fp32.log" 2>&1
step base-curve
measured coder05 || $PY -m tools.forward_cost --ckpt /work/real/coder05 \
  --dtypes bfloat16 --rows 1 --reps 3 --out "$RUNS/forward_cost.json" > "$RUNS/curve-base.log" 2>&1
step done
