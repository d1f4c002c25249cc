# Inside serve.py's engine: the time of each step, by kind, with the engine in a thread of its own (as
# serve.start runs it) or in the thread that loaded the model (as python serve.py runs it). 32 requests of
# 64 tokens through 8 clients, 8 rows, bf16, each budget fixed for the whole run (-1: plain AR).
#   .venv/bin/python results/serve_steps.py CKPT PROMPTS.jsonl [BUDGET ...]    (default: -1 2)
import collections
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import serve  # noqa: E402
from mars.checkpoint import load_model  # noqa: E402
from mars.tokenizer import Tokenizer  # noqa: E402
from tools.bench_serve import post, read_rows  # noqa: E402


def run(model, tok, ckpt: str, batch: list[dict], fixed: int, where: str) -> str:
    s = serve.Settings(ckpt=ckpt, port=0, max_rows=8, max_queue=64, max_tokens=64, draft_budget="auto")
    engine = serve.Engine(model, tok, s)
    engine.policy.budget = lambda R: fixed
    log, step = [], engine.step

    def timed(only=None):  # (rows, tokens, seconds, a row joined)
        t0, n, before = time.perf_counter(), engine.busy_slots(), engine.totals["tokens"]
        joining = any(engine.kv.lengths[b] == 0 for b in range(n))
        step(only)
        log.append((n, engine.totals["tokens"] - before, time.perf_counter() - t0, joining))

    engine.step = timed
    server = serve.start(engine, engine_thread=where == "thread")
    wall = {}

    def clients():
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda r: post(server.url, {"messages": r["messages"], "max_tokens": 64}), batch))
        wall["s"] = time.perf_counter() - t0
        if where == "main":
            engine.stop()

    if where == "main":
        threading.Thread(target=clients).start()
        engine.run()
    else:
        clients()
    server.close()
    kinds = collections.defaultdict(list)
    for n, tokens, seconds, joining in log:
        kind = "joining" if joining else "decode at 8 rows" if n == 8 else "decode, fewer rows"
        kinds[kind].append((tokens, seconds))
    parts = [f"{k}: {len(v)} steps, {1000 * sum(x for _, x in v) / len(v):.0f} ms a step, "
             f"{sum(t for t, _ in v) / sum(x for _, x in v):.1f} tokens/s" for k, v in sorted(kinds.items())]
    rate = len(batch) * 64 / wall["s"]
    place = "in a thread of its own" if where == "thread" else "in the thread that loaded the model"
    return f"budget {fixed}, engine {place}: {rate:.1f} tokens/s; " + "; ".join(parts)


def main() -> None:
    ckpt, prompts, *budgets = sys.argv[1:]
    tok = Tokenizer.from_pretrained(ckpt)
    rows = read_rows(prompts)
    batch = [rows[i % len(rows)] for i in range(32)]
    model = load_model(ckpt, "cpu", torch.bfloat16)
    for fixed in map(int, budgets or ["-1", "2"]):
        for where in ("thread", "main"):
            print(run(model, tok, ckpt, batch, fixed, where), flush=True)


if __name__ == "__main__":
    main()
