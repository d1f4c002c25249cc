# Scores every committed HumanEval reply (results/real_samples/*.jsonl) again with eval.py's scoring as it
# is now, and prints each reply whose verdict differs from the one stored with it. Run it after a change to
# the scoring: no line of changes means no committed number moves.
#   .venv/bin/python results/rescore.py
import glob
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval as ev  # noqa: E402

problems = {p["task_id"]: p for p in ev.humaneval_problems()}
with ThreadPoolExecutor(2) as pool:
    for f in sorted(glob.glob(str(ROOT / "results" / "real_samples" / "*.jsonl"))):
        rows = [json.loads(line) for line in open(f)]
        verdicts = pool.map(lambda r: ev.score("humaneval", {"problem": problems[r["task_id"]]}, r["reply"], 10), rows)
        changed = [(r["task_id"], r["mode"], r["passed"], v) for r, v in zip(rows, verdicts) if v != r["passed"]]
        print(f"{Path(f).name}: {len(rows)} replies, {len(changed)} changed {changed or ''}", flush=True)
