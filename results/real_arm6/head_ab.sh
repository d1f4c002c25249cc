#!/bin/bash
# The LM head's change alone: batch 1 on the first 8 as in after.sh, with the head called twice a step
# (generate.HEAD_ROWS = 0, the old rule), ar and verify side by side in one run; then the base's cost
# curve on this machine, for the limit. Run after after.sh.
cd /work/main
PY=.venv/bin/python
PYTHONPATH=. $PY - > runs/real8/arm6-b1-twice.log 2>&1 <<'PY'
import torch
import generate
generate.HEAD_ROWS = 0
import eval as evaluate
torch.set_grad_enabled(False)
evaluate.main(["--ckpt", "runs/real8/arm6", "--task", "humaneval", "--limit", "8", "--modes", "ar", "verify",
               "--batch-size", "1", "--dtype", "bfloat16", "--max-new-tokens", "512",
               "--out", "runs/real8/arm6-b1-twice.json"])
PY
$PY -m tools.forward_cost --ckpt /work/real/coder05 --dtypes bfloat16 --rows 1 --reps 3 \
  --out runs/real8/forward_cost.json > runs/real8/curve-base.log 2>&1
