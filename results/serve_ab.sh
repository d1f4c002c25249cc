#!/bin/bash
# serve.py at two commits on one adapter, side by side: tools.bench_serve with the three policies on the
# first 16 HumanEval prompts (8 clients, 16 requests, 64 tokens each, 8 rows, bf16), in the order old, new,
# new, old. Each commit runs from a worktree of its own with this checkout's venv.
#   results/serve_ab.sh OLD NEW NAME CKPT RUNS      (writes RUNS/NAME/)
#   REQUESTS=48 results/serve_ab.sh ...             (each prompt three times: a longer load)
set -e
. "$(dirname "$0")/ab_setup.sh"
$PY -c "
import json, eval as ev
with open('$R/prompts.jsonl', 'w') as f:
    for p in ev.humaneval_problems()[:16]:
        f.write(json.dumps({'messages': [{'role': 'user', 'content': ev.code_prompt(p['prompt'])}]}) + '\n')"
serve() { (cd /tmp/mars-$1 && $PY -m tools.bench_serve --ckpt "$CKPT" --prompts "$R/prompts.jsonl" \
  --policies adaptive full-tree ar --clients 8 --requests ${REQUESTS:-16} --max-tokens 64 --max-rows 8 --dtype bfloat16 \
  --out "$R/$2.json" --model "$2" > "$R/$2.log" 2>&1); }
serve $OLD_COMMIT old1; serve $NEW_COMMIT new1; serve $NEW_COMMIT new2; serve $OLD_COMMIT old2
