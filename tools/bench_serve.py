# A bounded load test of serve.py over loopback HTTP: requests/s, tokens/s and latency as the number
# of concurrent clients ramps up, for three serving policies, side by side in one run:
#   adaptive   the default server: greedy rows self-verify (docs/method.md §9) within a draft budget
#              sized each step to the rows it runs (--draft-budget auto);
#   full tree  the same with every verify row feeding the full tree (--draft-budget 0);
#   ar         plain AR ("threshold": 1.0 on each request), one token per forward.
# Every policy decodes greedy, exactly: each request's text is compared with the text the same server
# gives it alone (greedy_identical of greedy_total). Levels run policy after policy, so drift on a noisy
# machine spreads over all three. With prompts that carry "family" and "answer" (mars/tasks.py's test set),
# the responses are also scored with tasks.is_correct. Each server is `python serve.py` in a process of
# its own, as it is deployed: its engine runs in the thread that loaded the model (serve.py says why).
#
#   python -m tools.bench_serve --ckpt runs/demo/mars --prompts data/demo/test.jsonl --clients 1 16
#   python -m tools.bench_serve ... --out results/serving.json --model demo   # merged under "demo"
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mars import cli, tasks
from mars.checkpoint import DEFAULT_CKPT, check_checkpoint
from mars.cli import device_and_dtype
from mars.files import read_json, write_atomic
from mars.prompts import read_prompts
from tools.bench import BUILTIN_PROMPTS
from tools.forward_cost import cpu_name

ROOT = Path(__file__).resolve().parent.parent

POLICIES = {"adaptive": ("auto", {}), "full tree": ("0", {}), "ar": ("auto", {"threshold": 1.0})}


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint to serve
    prompts: str = ""  # JSONL with "messages" (e.g. data/demo/test.jsonl); empty = four built-in prompts
    policies: list[str] = field(default_factory=lambda: list(POLICIES))  # adaptive, full tree (full-tree), ar
    clients: list[int] = field(default_factory=lambda: [1, 16])  # concurrent clients, one level at a time
    requests: int = 32  # requests per level and policy; the prompts cycle to fill them
    max_tokens: int = 128  # per request
    max_rows: int = 16  # rows decoded together
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    out: str = ""  # JSON file to merge the results into (e.g. results/serving.json); empty = print only
    model: str = ""  # the results' key in --out; empty = the checkpoint folder's name


def read_rows(path: str) -> list[dict]:
    # JSONL (as for generate.py) -> rows with "messages", keeping "family" and "answer" for scoring.
    if not path:
        return [{"messages": [{"role": "user", "content": p}]} for p in BUILTIN_PROMPTS]
    return [row if "messages" in row else {"messages": [{"role": "user", "content": row["prompt"]}]}
            for _, row in read_prompts(path)]


def post(url: str, body: dict) -> tuple[float, dict]:
    # (seconds, response JSON) of one chat completion
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return time.perf_counter() - t0, json.loads(r.read())
    except urllib.error.HTTPError as e:  # a 400 (prompt too long) or 429 (server limits): say which
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode()[:300]}") from e


class ServerProcess:
    # `python serve.py` on a free loopback port, with its stderr kept; close() drains it (SIGTERM).
    def __init__(self, s: Settings, budget: str):
        cmd = [sys.executable, str(ROOT / "serve.py"), "--ckpt", s.ckpt, "--port", "0", "--quiet",
               "--max-rows", str(s.max_rows), "--max-queue", str(max(s.clients) + s.requests),
               "--max-tokens", str(s.max_tokens), "--draft-budget", budget, "--dtype", s.dtype, "--device", s.device]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.log: list[str] = []
        self.url, ready = "", threading.Event()

        def read() -> None:  # the log, and the line that says where it serves
            for line in self.proc.stderr:
                self.log.append(line)
                if line.startswith("serving ") and " on http" in line:
                    self.url = line.split(" on ")[1].split()[0]
                    ready.set()
            ready.set()  # it exited

        threading.Thread(target=read, daemon=True).start()
        ready.wait()
        if not self.url:
            self.proc.wait()
            raise RuntimeError(f"serve.py --draft-budget {budget} did not start:\n{''.join(self.log[-20:])}")

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def text(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def level(url: str, rows: list[dict], clients: int, extra: dict, max_tokens: int, alone: list[str]) -> dict:
    # One load level: len(rows) requests through `clients` concurrent clients, with `extra` in each body.
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda row: post(url, {"messages": row["messages"], "max_tokens": max_tokens,
                                                       **extra}), rows))
    wall = time.perf_counter() - t0
    latency = sorted(t for t, _ in results)
    tokens = sum(r["usage"]["completion_tokens"] for _, r in results)
    scored = [(row, r) for row, (_, r) in zip(rows, results) if "family" in row and "answer" in row]
    return {"clients": clients, "requests": len(rows), "requests_per_s": len(rows) / wall,
            "tokens_per_s": tokens / wall, "p50_s": latency[len(latency) // 2],
            "p95_s": latency[min(len(latency) - 1, int(0.95 * len(latency)))],
            "tokens_per_forward": tokens / sum(r["mars"]["forwards"] for _, r in results),
            "greedy_identical": sum(text(r) == a for (_, r), a in zip(results, alone)), "greedy_total": len(rows),
            "accuracy": sum(tasks.is_correct(row, text(r)) for row, r in scored) / len(scored) if scored else None}


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Load test of serve.py on loopback: three policies, side by side.")
    policies = [p.replace("-", " ") for p in s.policies]
    cli.at_least_1(s, "clients", "requests")
    if s.out:  # the results of other models stay in it: read now, not after every level
        cli.output_file(s.out, "--out")
        try:
            earlier = read_json(s.out, "fix it, or give another --out") if Path(s.out).exists() else {}
        except ValueError as e:
            sys.exit(f"error: {e}")
    try:
        if bad := [p for p in policies if p not in POLICIES]:
            raise ValueError(f"--policies {' '.join(bad)}: choose from adaptive, full-tree, ar")
        rows = read_rows(s.prompts)
        path = check_checkpoint(s.ckpt)[0]
        device, dtype = device_and_dtype(s.device, s.dtype)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    servers = {}
    print({**asdict(s), "device": device, "dtype": str(dtype)}, file=sys.stderr)
    batch = [rows[i % len(rows)] for i in range(s.requests)]
    table = {p: [] for p in policies}
    try:
        for budget in sorted({POLICIES[p][0] for p in policies}):
            servers[budget] = ServerProcess(s, budget)
        alone = {}
        for p in policies:  # every distinct prompt alone first: the texts the loaded runs must give
            budget, extra = POLICIES[p]
            url = servers[budget].url
            post(url, {"messages": batch[0]["messages"], "max_tokens": 4, **extra})  # warm-up
            lone = [text(post(url, {"messages": r["messages"], "max_tokens": s.max_tokens, **extra})[1])
                    for r in rows[:s.requests]]
            alone[p] = [lone[i % len(rows)] for i in range(s.requests)]
        for c in s.clients:
            for p in policies:
                budget, extra = POLICIES[p]
                table[p].append(level(servers[budget].url, batch, c, extra, s.max_tokens, alone[p]))
                print(f"{p}, {c} clients: {table[p][-1]['requests_per_s']:.2f} requests/s", file=sys.stderr)
        climbed = servers["auto"].metrics() if "auto" in servers else {}
        budgets = climbed.get("draft_budget_by_rows", {})  # R -> where its climb stands (AR: -1)
        ran = climbed.get("draft_budget_steps", {})  # R -> budget -> steps run, over the whole run
    finally:
        for server in servers.values():
            server.close()

    print("| policy | clients | requests/s | tokens/s | p50 s | p95 s | tokens/forward | greedy identical | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p, levels in table.items():
        for r in levels:
            acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
            print(f"| {p} | {r['clients']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['tokens_per_forward']:.2f} | "
                  f"{r['greedy_identical']}/{r['greedy_total']} | {acc} |")
    if s.out:
        out = Path(s.out)  # read again: another run may have added its model since
        report = {**earlier, **(read_json(out, "fix it, or give another --out") if out.exists() else {})}
        report[s.model or Path(path).name] = {
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "device": device, "dtype": str(dtype),
            "settings": asdict(s), "draft_budget_by_rows": budgets,
            "draft_budget_steps": ran, "policies": table}
        write_atomic(out, json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
