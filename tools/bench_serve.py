# A bounded load test of serve.py over loopback HTTP: requests/s, tokens/s and latency as the number
# of concurrent clients ramps up, in four settings, each pinned by a request field:
#   tau = 1.0                  "threshold": 1.0, exact AR at every load;
#   verify                     "verify": true, exact greedy tokens (docs/method.md §9) at every load;
#   adaptive, tau 1.0 if free  "verify": false, the load policy with tau 1.0 while rows are free;
#   adaptive, verify if free   no field: the server's default policy, self-verify while rows are free.
#
# Each client sends its next request as soon as the last one returns (a closed loop), so N clients
# keep about N rows busy. With prompts that carry "family" and "answer" (tasks.py's test set), the
# responses are also scored with tasks.is_correct: what the speed knob costs in accuracy.
#
#   python -m tools.bench_serve --ckpt runs/demo/mars --prompts data/demo/test.jsonl --clients 1 4 8 16
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import cli
import serve
import tasks
from checkpoint import DEFAULT_CKPT, check_checkpoint, device_and_dtype
from model import Transformer
from prompts import read_prompts
from tokenizer import Tokenizer
from tools.bench import BUILTIN_PROMPTS


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint to serve in-process (unused with --url)
    url: str = ""  # a running server on loopback, e.g. http://127.0.0.1:8000; empty = start one here
    prompts: str = ""  # JSONL with "messages" (e.g. data/demo/test.jsonl); empty = four built-in prompts
    clients: list[int] = field(default_factory=lambda: [1, 4, 8, 16])  # concurrent clients, one level at a time
    requests: int = 32  # requests per level and setting; the prompts cycle to fill them
    max_tokens: int = 128  # per request
    max_rows: int = 16  # in-process server: rows decoded together
    tau_min: float = 0.7  # in-process server: the policy's lowest tau
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N


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


SETTINGS = {"tau = 1.0": {"threshold": 1.0}, "verify": {"verify": True},
            "adaptive, tau 1.0 if free": {"verify": False}, "adaptive, verify if free": {}}


def level(url: str, rows: list[dict], clients: int, extra: dict, max_tokens: int) -> dict:
    # One load level: len(rows) requests through `clients` concurrent clients, with `extra` in each body.
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda row: post(url, {"messages": row["messages"], "max_tokens": max_tokens,
                                                       **extra}), rows))
    wall = time.perf_counter() - t0
    latency = sorted(t for t, _ in results)
    tokens = sum(r["usage"]["completion_tokens"] for _, r in results)
    scored = [(row, r) for row, (_, r) in zip(rows, results) if "family" in row and "answer" in row]
    return {"clients": clients, "requests_per_s": len(rows) / wall, "tokens_per_s": tokens / wall,
            "p50_s": latency[len(latency) // 2], "p95_s": latency[min(len(latency) - 1, int(0.95 * len(latency)))],
            "tokens_per_forward": tokens / sum(r["mars"]["forwards"] for _, r in results),
            "min_tau": min(r["mars"]["threshold_min"] for _, r in results),
            "accuracy": sum(tasks.is_correct(row, r["choices"][0]["message"]["content"]) for row, r in scored)
            / len(scored) if scored else None}


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Load test of serve.py on loopback: throughput and latency vs clients.")
    try:
        rows = read_rows(s.prompts)
        if s.url and urlsplit(s.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"--url {s.url}: this benchmark only targets loopback servers")
        path = None if s.url else check_checkpoint(s.ckpt)[0]
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    server = None
    if not s.url:
        device, dtype = device_and_dtype(s.device, s.dtype)
        model = Transformer.from_pretrained(path, device=device, dtype=dtype).eval()
        settings = serve.Settings(ckpt=s.ckpt, port=0, max_rows=s.max_rows, max_queue=max(s.clients),
                                  tau_min=s.tau_min, max_tokens=s.max_tokens)
        server = serve.start(serve.Engine(model, Tokenizer.from_pretrained(path), settings))
    url = s.url.rstrip("/") or server.url
    print({**asdict(s), "url": url}, file=sys.stderr)
    batch = [rows[i % len(rows)] for i in range(s.requests)]
    try:
        post(url, {"messages": batch[0]["messages"], "max_tokens": 4})  # warm-up
        table = [{"setting": name, **level(url, batch, c, extra, s.max_tokens)}
                 for name, extra in SETTINGS.items() for c in s.clients]
    finally:
        if server:
            server.close()

    print("| setting | clients | requests/s | tokens/s | p50 s | p95 s | tokens/forward | min tau | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        print(f"| {r['setting']} | {r['clients']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['tokens_per_forward']:.2f} | {r['min_tau']:.2f} | "
              f"{acc} |")


if __name__ == "__main__":
    main()
