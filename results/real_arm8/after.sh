#!/bin/bash
# After arm 8's training (docs/real-model.md): its cost curve at batch 1, then the three
# evaluations in the plan's order. One job at a time; a rerun skips the curve once it is written and
# resumes each evaluation from its decoded replies. eval.py's sandbox needs bubblewrap (apt install
# bubblewrap). runs/real10/base.json: results/real.json's base entry; base.samples.jsonl:
# results/real_samples/base.jsonl with task_id renamed id.
cd /work/main
PY=.venv/bin/python
step() { echo "$1 start $(date +%T)" >> runs/real10/progress.txt; }
step curve
[ -f runs/real10/forward_cost.json ] || $PY -m tools.forward_cost --ckpt runs/real10/arm8 --dtypes bfloat16 --rows 1 --reps 3 \
  --out runs/real10/forward_cost.json > runs/real10/curve.log 2>&1
step b1
$PY eval.py --ckpt runs/real10/arm8 --task humaneval --limit 8 --modes ar verify verify-tree \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out runs/real10/arm8-b1.json > runs/real10/arm8-b1.log 2>&1
step 164
$PY eval.py --ckpt runs/real10/arm8 --task humaneval --modes verify --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline runs/real10/base.json --out runs/real10/arm8.json --resume > runs/real10/arm8-164.log 2>&1
step fp32
$PY eval.py --ckpt runs/real10/arm8 --task humaneval --limit 16 --modes ar verify --batch-size 8 \
  --dtype float32 --max-new-tokens 512 --out runs/real10/arm8-fp32.json --resume > runs/real10/arm8-fp32.log 2>&1
step done
