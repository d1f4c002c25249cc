# An OpenAI-compatible server (chat, and text completions) for MARS with continuous batching
# (docs/method.md §6, §7, §9; docs/serving.md).
#
# One thread, the engine, owns the model and a cursor KV cache with --max-rows row slots: under
# `python serve.py` the main thread, the one that loaded the model and measured it. Torch's CPU thread
# pool (OpenMP) belongs to the thread that calls it, and a second pool in the process (the model loaded
# in one thread, decoded in another) made each small op ~10x slower on a 2-core CPU, a verify step
# 2x (docs/real-model.md). Each step it
# drops rows whose client went away, moves the last busy row into any free slot below it (with its
# cache entries), admits waiting requests into the free slots after the running rows, runs one
# generate.decode_step over the running rows and one over the rows that join (their prompts would pad
# every running row to their length), commits each row's real tokens, and hands the new text to the
# request's HTTP thread through a queue. A request joins at the next step and leaves at the step it
# finishes: nobody waits for the slowest row.
#
# The speed knob is live, per row and per step. Greedy rows self-verify (§9): the same tokens as tau
# 1.0 whatever the load, and the load sets only how many draft positions each row feeds (the draft
# budget, sized each step to the rows running from the measured cost of a forward). Only where the
# operator allows it (--tau-min < 1) does tau itself fall as rows fill. The knob is load_tau() and
# Engine.step (with Engine.groups), read in that order below.
# A request may pin its mode: "threshold": tau, or "verify": true (OpenAI clients: extra_body).
#
# The HTTP layer, hardened so that no request stalls the others and no web page drives the server,
# is http_server.py; this file adds the OpenAI routes and their wire format.
#
#   python serve.py --ckpt runs/demo/mars --port 8000
#   curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
#        -d '{"messages": [{"role": "user", "content": "Hi"}]}'
from __future__ import annotations

import errno
import json
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import torch

from generate import Group, Options, decode_step, window
from kvcache import KVCache
from mars import budget, cli, http_server, quantize
from mars.checkpoint import (
    DEFAULT_CKPT,
    check_checkpoint,
    check_mask_row,
    load_model,
    trained_block_size,
    warn_untrained_masks,
)
from mars.cli import device_and_dtype
from mars.http_server import Limits, error_body, exposure_warning, held_back, stop_cut
from mars.layout import Drafts, check_block_size
from mars.tokenizer import Tokenizer, plain_messages
from model import Transformer

WINDOW_S = 10.0  # /metrics reports tokens/s and tokens per forward over this many recent seconds
# /v1/completions: OpenAI's legacy route for text, as lm-evaluation-harness's local-completions calls it
ROUTES = {"/health": "GET", "/metrics": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST",
          "/v1/completions": "POST"}


def load_tau(running: int, queued: int, max_rows: int, tau_max: float, tau_min: float) -> float:
    # The load policy: load = (running rows + queued requests) / max_rows, then
    #   tau = tau_max - (tau_max - tau_min) * clamp(2 * load - 1, 0, 1).
    # Up to half the rows busy the batch has spare width, so rows decode at tau_max (exact AR at 1.0).
    # From half to all rows busy tau falls linearly; once every row is busy or a queue forms it stays at
    # tau_min, where a row takes the most tokens per forward, finishes soonest and frees its slot.
    x = min(max(2 * (running + queued) / max_rows - 1, 0.0), 1.0)
    return round(tau_max - (tau_max - tau_min) * x, 6)


# ---- the engine's cache: kvcache.KVCache with row slots that come and go ----

class ServerCache(KVCache):
    # The engine's cursor cache (§7) with what only a server needs: a view of a run of row slots that
    # shares the buffers (the running rows and the joining rows forward apart), moving a row into a free
    # slot below it, and emptying a finished row's slot.
    owner: ServerCache | None = None  # a rows() view's cache, which its commits reach too
    first = 0  # a view's first row in its owner

    def set_lengths(self, lengths: list[int]) -> None:
        super().set_lengths(lengths)
        if self.owner is not None:  # a view's rows are its owner's rows first .. first + batch_size - 1
            theirs, end = self.owner.lengths, self.first + len(self.lengths)
            self.owner.set_lengths(theirs[:self.first] + self.lengths + theirs[end:])

    def rows(self, first: int, end: int) -> ServerCache:
        # Rows first .. end - 1 as a cache of their own that shares these buffers (views, no copy): a
        # forward of those rows alone writes here, and a commit or truncate on it reaches this cache.
        view = ServerCache.__new__(ServerCache)
        view.k, view.v, view.max_len, view.first = self.k[:, first:end], self.v[:, first:end], self.max_len, first
        view.set_lengths(self.lengths[first:end])
        view.owner = self
        return view

    def keep_rows(self, rows: list[int]) -> None:
        if self.owner is not None:
            raise RuntimeError("keep_rows() on a view of rows: drop rows on the cache that owns the buffers")
        super().keep_rows(rows)

    def move(self, src: int, dst: int) -> None:
        # Row src's committed entries become row dst's, and src is empty: the server closes a gap in its
        # slots this way. One copy of that row's entries.
        if self.owner is not None:
            raise RuntimeError("move() on a view of rows: move rows on the cache that owns the buffers")
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.set_lengths([n if r == dst else 0 if r == src else m for r, m in enumerate(self.lengths)])

    def truncate(self, lengths: list[int]) -> None:
        # Forget entries past lengths[r] (they become scratch); the server empties a finished row's slot this way.
        self.set_lengths(lengths)


# ---- the engine: one thread, one model, one cache, continuous batching ----

def cache_columns(s: Settings, config) -> int:
    # The columns of each row of the server's cache. A step writes max(len of every row's fed tokens) columns at
    # each row's length: a joining prompt (< max_len) next to a verify row near the end (< max_len, then up to
    # B - 1 drafts and B mask groups of B - 1) needs up to 2 * max_len + B^2. A compiled step also writes pads to
    # the last W columns of the rows outside its forward.
    B = s.block_size or 4
    return (2 * min(s.max_len, config.max_position_embeddings) + B ** 2
            + (2 * max(step_widths(B)) if s.compile else 0))


def step_widths(B: int) -> list[int]:
    # The widths a compiled step may take (mars/compiled.py): AR rows, threshold rows, and verify rows at every
    # draft budget.
    from mars import compiled
    return sorted({compiled.width(Options(B=B, tau=tau)) for tau in (1.0, 0.5)}
                  | {compiled.width(Options(B=B, verify=True, draft_budget=d)) for d in range(B * B + 1)})


def check_cache_memory(model: Transformer, s: Settings) -> None:
    # The KV cache of --max-rows rows is allocated whole at the start: one line, before the draft budget is
    # measured, where it cannot fit in the memory the device has free.
    c, w = model.config, model.model.embed_tokens.weight
    columns = cache_columns(s, c)
    need = 2 * c.num_hidden_layers * s.max_rows * c.num_key_value_heads * columns * c.head_dim * w.element_size()
    free = free_bytes(w.device)
    if free is not None and need > free:
        raise ValueError(f"the KV cache of --max-rows {s.max_rows} rows, {columns} positions each (twice "
                         f"--max-len {min(s.max_len, c.max_position_embeddings)}, and a verify step's room"
                         f"{' and compile pads' if s.compile else ''}), needs "
                         f"{need / 2**30:.1f} GiB and {w.device} has {free / 2**30:.1f} GiB free: lower --max-rows "
                         "or --max-len")


def free_bytes(device: torch.device, cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    # The memory free for a new allocation on `device`, or None where it is not known (a CPU without /proc). On
    # the CPU, the machine's MemAvailable, or less where a container's cgroup (v2) limits the process.
    if device.type == "cuda":  # and what torch's allocator holds unused (a quantized model's freed weights)
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
            device)
    free = []
    try:
        with open("/proc/meminfo") as f:
            free += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:  # the limit less what the container holds, its page cache (inactive_file: reclaimable) aside
        held = int((cgroup / "memory.current").read_text()) - cgroup_stat(cgroup, "inactive_file")
        free.append(max(0, int((cgroup / "memory.max").read_text()) - held))
    except (OSError, ValueError):  # no cgroup v2 here, or "max": no limit
        pass
    return min(free) if free else None


def cgroup_stat(cgroup: Path, name: str) -> int:  # one counter of memory.stat, 0 where it is not there
    try:
        return next((int(line.split()[1]) for line in (cgroup / "memory.stat").read_text().splitlines()
                     if line.startswith(f"{name} ")), 0)
    except (OSError, ValueError, IndexError):
        return 0


class Engine:
    def __init__(self, model: Transformer, tok: Tokenizer, s: Settings):
        s = replace(s, block_size=s.block_size or 4)  # launch() gives the checkpoint's own B; a bare 0 means 4
        self.model, self.tok, self.s = model, tok, s
        # The draft budget of greedy verify rows: sized each step to the rows it runs, from the cost of
        # a forward measured here (--draft-budget auto), or fixed.
        self.policy = measured_policy(model, s) if s.draft_budget == "auto" else None
        self.max_len = min(s.max_len, model.config.max_position_embeddings)
        device = model.model.embed_tokens.weight.device
        self.kv = ServerCache(model.config, s.max_rows, cache_columns(s, model.config), device,
                              model.model.embed_tokens.weight.dtype)
        self.device = device
        self.seeds = random.Random(s.seed)  # the seed of each sampled request that gives none
        self.rows: list[Request | None] = [None] * s.max_rows  # slot -> its request; only run() writes it
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()  # guards rows, waiting, the counters; wakes an idle engine
        self.recent: deque[tuple[float, int, int]] = deque()  # (time, tokens, row steps) per step
        self.totals = dict(requests=0, finished=0, cancelled=0, rejected=0, failed=0, tokens=0, steps=0)
        self.started, self.stopped, self.budget_now = time.monotonic(), False, 0
        self.thread = threading.Thread(target=self.run, name="mars-engine", daemon=True)  # start() runs it
        self.began, self.done = False, threading.Event()  # run() has begun; it has returned
        self.draining = False  # set by Server.drain: submit() refuses new requests
        self.committed = False  # the running step has committed its tokens to the cache

    def widths(self) -> list[int]:  # the widths a compiled step of this engine may take
        return step_widths(self.s.block_size)

    def warm(self) -> None:
        # --compile: every width's step compiled before the first request, which would otherwise wait for it.
        from mars import compiled
        compiled.warm(self.model, self.kv, self.widths())

    def verifies(self, r: Request, tau: float) -> bool:
        # The request's own choice ("verify", or a "threshold", which means no), else the load policy:
        # self-verify while its tau is 1.0, where it would otherwise decode exact greedy AR.
        if r.verify is not None or r.threshold is not None or r.tolerance < 1.0:
            return bool(r.verify) or r.tolerance < 1.0
        return self.s.verify and tau >= 1.0

    def own_tau(self, r: Request | None, tau: float) -> float:
        # The tau row r decodes with, given the load policy's tau. The policy changes only greedy requests
        # that give neither a threshold nor a seed: a sampled or seeded request keeps the tau at rest
        # (tau_max), so its text depends on its seed alone, whatever the load.
        if r is None:
            return tau
        if r.threshold is not None:
            return r.threshold
        return self.s.tau_max if r.seed is not None or r.temperature > 0 else tau

    def groups(self, rows: list[Request | None], taus: list[float], draft_budget: int) -> list[Group]:
        # Busy rows that decode alike share a group of the step; a request with its own generator is a
        # group of its own, so its draws depend on its seed and its own slots alone, whatever the batch.
        # Only exact greedy verify rows take the load's budget: any budget gives them the same tokens. A
        # sampled or base-checked row's text depends on the drafts it was offered, so it keeps one budget.
        groups: dict[tuple[Options, torch.Generator | None], list[int]] = {}
        for b, r in enumerate(rows):
            if r is not None:
                exact = r.temperature == 0 and r.tolerance == 1.0
                opts = Options(tau=taus[b], temperature=r.temperature, top_p=r.top_p, verify=r.drafts is not None,
                               draft_budget=draft_budget if exact else budget.DEFAULT_BUDGET, tolerance=r.tolerance,
                               vocab_size=self.tok.vocab_size, B=self.s.block_size, compile=self.s.compile)
                groups.setdefault((opts, r.generator), []).append(b)
        return [Group(rows, opts, generator) for (opts, generator), rows in groups.items()]

    def step(self, only: int | None = None) -> None:
        # One forward for the busy rows; with only, for slot `only` alone, the others sitting out untouched.
        t0 = time.perf_counter()
        s, rows = self.s, [r if only is None or b == only else None for b, r in enumerate(self.rows)]
        with self.lock:  # the climb's tables, which budget() may add to, are what /metrics reads (climbed)
            tau = load_tau(self.running(), len(self.waiting), s.max_rows, s.tau_max, s.tau_min)
            n = self.busy_slots()
            draft_budget = chosen = self.policy.budget(n) if self.policy else int(s.draft_budget)
        taus = [self.own_tau(r, tau) for r in rows]
        # The budget may be plain AR for this step (budget.AR_STEP: at this many rows, drafts cost more than they
        # return): then the rows that verify by the load policy alone run as AR, the same greedy tokens.
        ar_step = draft_budget == budget.AR_STEP
        for r, t in zip(rows, taus):  # a row leaving verify mode drops its drafts; one entering starts without
            if r is not None:
                as_ar = ar_step and r.verify is None and r.temperature == 0 and r.tolerance == 1.0
                r.drafts = (r.drafts or Drafts()) if self.verifies(r, t) and not as_ar else None
        if ar_step:  # rows that still verify (they asked to) take the default budget
            draft_budget = budget.DEFAULT_BUDGET
        # 0 = a free slot; a row at tau 1 that does not verify takes one token a step by rule, so it feeds no
        # masks (generate.decode's B = 1)
        w = [window(len(r.out), s.block_size if r.drafts is not None or t < 1.0 else 1, r.max_tokens, 0) if r else 0
             for r, t in zip(rows, taus)]
        # the first row that joins now (a row that sits out this step, under `only`, neither joins nor runs)
        running = next((b for b in range(n) if self.kv.lengths[b] == 0 and rows[b] is not None), n)
        new, kept, drafts, offered, accepted, fed = self.forwards(rows[:n], w, taus, draft_budget, running)
        # cursor cache (§7): every busy row keeps the real tokens it fed and verified
        self.kv.commit(kept + [0] * (len(rows) - n))  # a row that sat out keeps 0 more
        self.committed = True  # from here a failure leaves the rows half updated
        with self.lock:
            self.budget_now = budget.AR_STEP if ar_step else draft_budget
            for b, r in enumerate(rows):
                if r is not None:
                    if r.drafts is not None:
                        taus[b] = 1.0
                        r.verified = [r.verified[0] + 1, r.verified[1] + offered[b], r.verified[2] + accepted[b]]
                        # the budget's acceptance is the exact greedy rows' own, the rows it sizes
                        if self.policy and new[b][-1] not in self.tok.stop_ids and r.tolerance == 1.0 \
                                and r.temperature == 0:
                            self.policy.observe(offered[b], accepted[b])
                        r.drafts = drafts[b]
                    r.out += new[b]
                    r.forwards += 1
                    r.tau, r.tau_low = taus[b], min(taus[b], r.tau_low)
                    self.emit(b, r)
            tokens = sum(map(len, new))
            self.recent.append((time.monotonic(), tokens, sum(x > 0 for x in w)))
            self.totals["tokens"] += tokens
            self.totals["steps"] += 1
            if self.policy:  # the step's whole cost and yield, for the budget's overhead term and its climb
                self.policy.timed(n, chosen, max(fed), time.perf_counter() - t0, tokens,
                                  running == n and only is None)

    def forwards(self, rows: list[Request | None], w: list[int], taus: list[float], draft_budget: int,
                 running: int) -> tuple[list, list, list, list, list, list]:
        # The step's decode_steps over slots 0..n-1 (rows): admit keeps the busy rows first, the rows that
        # join this step (from `running` on) after them. Those feed their whole prompts: in the same forward
        # every running row would be padded to the longest prompt, so they run a forward of their own.
        # -> per row: new tokens, kept tokens, next drafts, drafts fed for checking, drafts emitted, positions fed.
        n, new, kept, drafts, offered, accepted, fed = len(rows), [], [], [], [], [], []
        for first, end in ((0, running), (running, n)) if 0 < running < n else ((0, n),):
            part = rows[first:end]
            if not any(part):  # every row of this part sits out: no forward
                k = end - first
                new, kept, drafts = new + [[]] * k, kept + [0] * k, drafts + [None] * k
                offered, accepted, fed = offered + [0] * k, accepted + [0] * k, fed + [0] * k
                continue
            step = decode_step(self.model, [r.prompt + r.out if r else [] for r in part], w[first:end],
                               [r and r.drafts for r in part], self.kv.rows(first, end),
                               self.groups(part, taus[first:end], draft_budget), self.tok.mask_id,
                               self.tok.stop_ids)
            new, kept, drafts = new + step.new, kept + step.kept, drafts + step.drafts
            offered, accepted, fed = offered + step.offered, accepted + step.accepted, fed + step.fed
        return new, kept, drafts, offered, accepted, fed

    def emit(self, b: int, r: Request) -> None:
        # Sends the text that is now certain; finishes the row at a stop token, a stop string or max_tokens.
        stop_ids = self.tok.stop_ids
        text = self.tok.decode([t for t in r.out if t not in stop_ids])
        finish = "stop" if r.out[-1] in stop_ids else None
        cut = stop_cut(text, r.stop)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        finish = finish or ("length" if len(r.out) >= r.max_tokens else None)
        end = len(text) if finish else len(text) - held_back(text, r.stop)
        if end > r.shown:
            r.events.put(text[r.shown:end])
            r.shown = end
        if finish:
            self.free(b, "finished")
            n = len(r.out)
            mars = {"forwards": r.forwards, "tokens_per_forward": round(n / r.forwards, 4), "threshold": r.tau,
                    "threshold_min": r.tau_low}
            if r.verified[0]:  # the row self-verified in some steps (§9)
                mars |= dict(zip(("verify_steps", "drafts_offered", "drafts_accepted"), r.verified))
            used = n if cut < 0 else self.through_stop(r)  # a step may accept tokens past a stop string
            r.events.put({"finish_reason": finish,
                          "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": used,
                                    "total_tokens": len(r.prompt) + used},
                          "mars": mars})

    def through_stop(self, r: Request) -> int:
        # The tokens up to the one that completes the first stop string: what the reply used, as vLLM counts.
        def has_stop(k: int) -> bool:
            text = self.tok.decode([t for t in r.out[:k] if t not in self.tok.stop_ids])
            return any(stop in text for stop in r.stop)

        k = len(r.out)
        while k > 1 and has_stop(k - 1):
            k -= 1
        return k

    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def submit(self, r: Request) -> None:
        with self.lock:
            if self.draining:
                raise Draining("the server is shutting down; retry on another instance or once it is back")
            if self.running() + len(self.waiting) >= self.s.max_rows + self.s.max_queue:
                self.totals["rejected"] += 1
                raise Busy(f"server is full: {self.running()} rows running and {len(self.waiting)} requests "
                           f"queued (--max-rows {self.s.max_rows}, --max-queue {self.s.max_queue}); retry later")
            if r.temperature > 0:
                seed = self.seeds.getrandbits(63) if r.seed is None else r.seed
                r.generator = torch.Generator(device=self.device).manual_seed(seed)
            self.waiting.append(r)
            self.totals["requests"] += 1
            self.lock.notify()

    def cancel(self, r: Request) -> None:
        # The HTTP thread saw its client leave: a queued request leaves the queue now, a running row is
        # freed by admit() before the next step. A request that already finished is left alone.
        with self.lock:
            r.cancelled = True
            if r in self.waiting:
                self.waiting.remove(r)
                self.totals["cancelled"] += 1

    def run(self) -> None:
        # The engine's loop, until stop(): in its own thread (start()) or in the caller's (main()).
        self.began = True
        try:
            with torch.inference_mode():  # thread-local: it must be entered in the engine's own thread
                self.loop()
        finally:
            self.done.set()

    def loop(self) -> None:
        while True:
            with self.lock:
                self.admit()
                while not self.running() and not self.stopped:
                    # timed: when serve.py runs this loop in its main thread, Python runs a signal's handler (SIGTERM:
                    # drain) only between that thread's waits, and an untimed one could outlast the signal for good
                    self.lock.wait(0.25)
                    self.admit()
                if self.stopped:
                    return
            # a step that fails gives its seeded rows back their draws: a forward before the failing one drew
            draws = [(r.generator, r.generator.get_state()) for r in self.rows if r is not None and r.generator]
            try:
                self.committed = False
                self.step()
            except Exception:
                traceback.print_exc()
                if self.committed:  # the cache moved on and some rows did not: none can go on
                    self.fail([b for b, r in enumerate(self.rows) if r is not None])
                else:
                    for generator, state in draws:
                        generator.set_state(state)
                    self.isolate()

    def isolate(self) -> None:
        # A step failed before it changed anything (the cache's lengths and the rows' tokens change only
        # after its forwards and checks). Each busy row then runs a step alone: a row that fails alone
        # fails, and the rest go on, so a request that breaks a step (a prompt too long for the memory, a
        # bug its options reach) takes no other request with it.
        for b in [b for b, r in enumerate(self.rows) if r is not None]:
            try:
                self.step(only=b)
            except Exception:
                traceback.print_exc()
                self.fail([b])

    def fail(self, slots: list[int]) -> None:
        with self.lock:
            for b in slots:
                if (r := self.rows[b]) is not None:
                    self.free(b, "failed")
                    r.events.put({"error": "the engine failed on this request; see the server log"})

    def admit(self) -> None:
        # Under the lock, between steps: free rows whose client left, then fill free slots in FIFO order.
        # A free slot left below a busy one takes the last busy row (its cache entries move with it), so
        # a step forwards its busy rows alone, and the draft budget is sized to them.
        for b, r in enumerate(self.rows):
            if r is not None and r.cancelled:
                self.free(b, "cancelled")
        while (hole := self.rows.index(None) if None in self.rows else len(self.rows)) < self.busy_slots() - 1:
            last = self.busy_slots() - 1
            self.kv.move(last, hole)
            self.rows[hole], self.rows[last] = self.rows[last], None
        while self.waiting and None in self.rows:  # after the running rows, so the joining ones come last
            self.rows[self.rows.index(None)] = self.waiting.popleft()

    def busy_slots(self) -> int:  # 1 + the last busy slot
        return 1 + max((b for b, r in enumerate(self.rows) if r is not None), default=-1)

    def free(self, b: int, outcome: str) -> None:
        # The slot's committed length goes back to 0: the next request in it starts from an empty cache
        # and, by causality, can never attend to the old request's columns.
        self.rows[b] = None
        self.kv.truncate([0 if i == b else n for i, n in enumerate(self.kv.lengths)])
        self.totals[outcome] += 1

    def metrics(self) -> dict:
        with self.lock:
            now = time.monotonic()
            while self.recent and self.recent[0][0] < now - WINDOW_S:
                self.recent.popleft()
            tokens, row_steps = sum(t for _, t, _ in self.recent), sum(n for _, _, n in self.recent)
            running, queued = self.running(), len(self.waiting)
            tau = load_tau(running, queued, self.s.max_rows, self.s.tau_max, self.s.tau_min)
            return {"queue_depth": queued, "running_rows": running, "max_rows": self.s.max_rows,
                    "max_queue": self.s.max_queue, "tau": tau,
                    "verify": self.s.verify and tau >= 1.0,  # what a request without threshold or verify gets now
                    "draft_budget": self.budget_now,  # greedy verify rows' positions per row last step; -1: AR
                    "window_s": WINDOW_S,
                    "tokens_per_second": round(tokens / max(min(WINDOW_S, now - self.started), 1e-3), 2),
                    # per sequence, as in the paper: accepted tokens / (row, forward) pairs
                    "tokens_per_forward": round(tokens / row_steps, 4) if row_steps else None,
                    "totals": dict(self.totals), **self.climbed()}

    def climbed(self) -> dict:
        # Under --draft-budget auto, where each row count's climb stands (AR: -1) and the steps each budget
        # ran at each row count, since launch: what tools/bench_serve.py reports.
        if not self.policy:
            return {}
        climb, steps = self.policy.climb, {}
        for (R, b), n in sorted(climb.ran.items()):
            steps.setdefault(R, {})[b] = n
        return {"draft_budget_by_rows": {R: climb.rungs[i] for R, i in sorted(climb.at.items())},
                "draft_budget_steps": steps}

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        if self.began:  # a loop that has not begun yet returns at once, seeing stopped
            self.done.wait()
        for r in [*filter(None, self.rows), *self.waiting]:  # no HTTP thread waits forever
            r.events.put({"error": "the server is shutting down"})


def measured_policy(model: Transformer, s: Settings) -> budget.Policy:
    # t_R(n) at R = 1, 2, 4, ... up to max_rows and the widths a verify row can feed, a few seconds at
    # launch; the prior acceptance is a trained adapter's (docs/method.md §9), replaced by the rows' own.
    # Each time is the median of budget.REPS rounds, as --draft-budget auto's, so one round slowed by load
    # does not bend a curve.
    G = s.block_size - 1
    widths = budget.widths(G)
    curves = {R: budget.measure(model, R, widths, context=64, reps=budget.REPS) for R in measured_rows(s.max_rows)}
    return budget.Policy(widths, curves, G, prior=budget.PRIOR)


def measured_rows(max_rows: int) -> list[int]:  # the row counts measured_policy times: 1, 2, 4, ..., max_rows
    return sorted({min(2 ** i, max_rows) for i in range(max_rows.bit_length() + 1)})


def measuring_seconds(model: Transformer, s: Settings) -> float:
    # About how long measured_policy takes here, priced from two forwards timed now (one row at one
    # position, every row at the widest), a forward's time taken as linear in the positions it feeds.
    widths = budget.widths(s.block_size - 1)
    small, large = (budget.measure(model, R, [n], context=64, reps=1)[0] for R, n in ((1, 1), (s.max_rows, widths[-1])))
    per = max(large - small, 0.0) / max(s.max_rows * widths[-1] - 1, 1)  # seconds per position fed

    def forward(positions: int) -> float:
        return small + per * (positions - 1)

    return sum(forward(64 * R) + (budget.REPS + 1) * sum(forward(n * R) for n in widths)
               for R in measured_rows(s.max_rows))


# ---- requests: parsed and checked in the HTTP thread, decoded in the engine thread ----

class BadRequest(Exception):  # -> 400 with an OpenAI-style error body
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class UnknownModel(BadRequest):  # -> 404, as OpenAI and vLLM answer a model they do not serve
    pass


class Busy(Exception):  # -> 429: every row is busy and the queue is full
    pass


class Draining(Exception):  # -> 503: the server is shutting down
    pass


@dataclass(eq=False)  # compared by identity: the engine finds and removes this very request
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float  # 0 = greedy, the paper's setting (and our default, unlike OpenAI's 1.0)
    stop: list[str]  # strings that end the output; the text is cut before the first one
    threshold: float | None  # the request's own tau; None = the server's load policy
    stream: bool
    seed: int | None = None  # the sampling generator's seed; None = drawn from the server's --seed
    usage_chunk: bool = False  # stream_options.include_usage: usage in a last chunk of its own (no choices)
    generator: torch.Generator | None = None  # this request's own, so its draws never depend on the batch
    verify: bool | None = None  # True: always self-verify; False: never; None: the server's load policy
    tolerance: float = 1.0  # < 1: base-checked verify (lossy), drafts kept while rated >= tolerance x the top
    top_p: float = 1.0  # sampling: the nucleus (generate.Options.top_p); a greedy row's is 1.0, which it cannot change
    events: queue.Queue = field(default_factory=queue.Queue)  # engine -> HTTP thread: str deltas, then a dict
    cancelled: bool = False  # set by Engine.cancel when the client went away; the engine frees the row
    out: list[int] = field(default_factory=list)  # accepted tokens, stop token included
    shown: int = 0  # characters of the output text already put on `events`
    forwards: int = 0  # steps this row took part in (the prompt's counts, §6)
    tau: float = 1.0  # tau of the row's last step
    tau_low: float = 1.0  # lowest tau any of its steps used (a verify step counts as 1.0: exact)
    drafts: Drafts | None = None  # while the row verifies: the drafts its last step proposed (§9)
    verified: list[int] = field(default_factory=lambda: [0, 0, 0])  # verify steps, drafts offered, accepted


MAX_STOPS, MAX_STOP_CHARS = 4, 256  # stop strings per request (OpenAI's limit) and characters in each
# Request fields this server cannot honour: refused unless they hold one of their "off" values, rather
# than silently ignored. field -> (off values, what is missing)
UNSUPPORTED = {
    "tools": ([[]], "tool calling"), "functions": ([[]], "tool calling"),
    "tool_choice": (["none", "auto"], "tool calling"), "function_call": (["none", "auto"], "tool calling"),
    "response_format": ([{"type": "text"}], "constrained (JSON) output"),
    "logprobs": ([False], "log-probabilities"), "top_logprobs": ([0], "log-probabilities"),
    "logit_bias": ([{}], "logit bias"),
    "presence_penalty": ([0], "repetition penalties"), "frequency_penalty": ([0], "repetition penalties"),
    "echo": ([False], "prompt echo"), "best_of": ([1], "best-of sampling"), "suffix": ([""], "insertion (suffix)"),
}
PROMPTS = {"messages": "a list of {'role', 'content'} objects",  # each route's prompt field: chat's, completions'
           "prompt": "a string (the text to continue)"}


def request_body(raw: bytes, prompt: str) -> dict:
    # The body of a POST as a JSON object with its prompt field (PROMPTS) and no unsupported field.
    try:
        body = json.loads(raw)
    except ValueError as e:  # bad JSON, not UTF-8, or an integer of more than 4300 digits
        raise BadRequest(f"request body is not valid JSON: {str(e)[:200]}") from e
    except RecursionError as e:
        raise BadRequest("request body is nested too deeply") from e
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if prompt not in body:
        raise BadRequest(f"missing required field '{prompt}': {PROMPTS[prompt]}", prompt)
    for name, (off, what) in UNSUPPORTED.items():
        if body.get(name) is not None and not any(same_json(body[name], o) for o in off):
            raise BadRequest(f"'{name}' is not supported: this server has no {what}; leave it out",
                             name, "unsupported_parameter")
    return body


def same_json(a, b) -> bool:
    # JSON's 0 and 0.0 alike, but 0 is not false: on /v1/completions, logprobs 0 asks for the chosen tokens' own.
    return a == b and (type(a) is bool) == (type(b) is bool)


def checked(body: dict, name: str, kind: type, default, ok=lambda v: True, want: str = ""):
    # body[name] if it is a `kind` that passes ok, default if absent (or null, as some clients send
    # for "unset"); else BadRequest naming the field and `want`.
    v = body.get(name)
    if v is None:
        return default
    if kind is float and type(v) is int:
        v = float(v)
    if type(v) is not kind or not ok(v):  # type(), not isinstance: True is not a number here
        raise BadRequest(f"'{name}' must be {want or kind.__name__}, got {json.dumps(v)[:60]}", name)
    return v


def parse_request(raw: bytes, tok: Tokenizer, s: Settings, max_len: int, chat: bool = True,
                  name: str | None = None) -> Request:
    # The body of POST /v1/chat/completions (chat) or /v1/completions (a text prompt, continued as it is)
    # -> a Request; anything wrong -> BadRequest naming the field. name: the model served; a request that
    # names another one gets UnknownModel (a request may leave out "model").
    field = "messages" if chat else "prompt"
    body = request_body(raw, field)
    model = checked(body, "model", str, None)
    if name is not None and model is not None and model not in (name, quote(name), quote(name, safe="")):
        raise UnknownModel(f"the model '{model[:100]}' is not served here; this server serves '{name}' "
                           "(GET /v1/models)", "model", "model_not_found")
    temperature = checked(body, "temperature", float, 0.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")
    threshold = checked(body, "threshold", float, None, lambda v: 0 <= v <= 1, "a number in [0, 1] (MARS tau)")
    stream = checked(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("'stream_options' goes with 'stream': true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object: {\"include_usage\": true}", "stream_options")
    usage_chunk = checked(options or {}, "include_usage", bool, False)
    seed = checked(body, "seed", int, None, lambda v: -2**63 <= v < 2**64, "a 64-bit integer")
    verify = checked(body, "verify", bool, None)
    if verify and threshold is not None:
        raise BadRequest("'threshold' and 'verify': true exclude each other: verify emits exactly the greedy "
                         "tokens, so no threshold applies; send one of them", "verify")
    tolerance = checked(body, "tolerance", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = exact verify)")
    if tolerance < 1 and (threshold is not None or verify is False or temperature > 0):
        raise BadRequest("'tolerance' is base-checked verify: greedy (temperature 0), with no 'threshold' and "
                         "no 'verify': false", "tolerance")
    checked(body, "n", int, 1, lambda v: v == 1, "1 (one choice per request)")
    top_p = checked(body, "top_p", float, 1.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOPS
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop)):
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOPS} strings of 1 to "
                         f"{MAX_STOP_CHARS} characters, got {json.dumps(body['stop'])[:60]}", "stop")
    asked = {name: checked(body, name, int, None, lambda v: v >= 1, "an integer >= 1")
             for name in ("max_tokens", "max_completion_tokens")}
    if None not in asked.values() and asked["max_tokens"] != asked["max_completion_tokens"]:
        raise BadRequest(f"'max_tokens' ({asked['max_tokens']}) and 'max_completion_tokens' "
                         f"({asked['max_completion_tokens']}) differ; send one of them", "max_tokens")
    limit = "max_completion_tokens" if asked["max_completion_tokens"] is not None else "max_tokens"
    prompt = chat_prompt(body["messages"], tok) if chat else text_prompt(body["prompt"], tok)
    max_tokens = fit_context(prompt, asked[limit], limit, s.max_tokens, max_len, field)
    # A greedy row ignores top_p (its token is in every nucleus): 1.0 lets it share its group with the others.
    return Request(prompt, max_tokens, temperature, stop, threshold, stream, seed, verify=verify, tolerance=tolerance,
                   top_p=top_p if temperature > 0 else 1.0, usage_chunk=usage_chunk)


def chat_prompt(messages, tok: Tokenizer) -> list[int]:
    # The messages rendered by the chat template, ready for the assistant's reply.
    try:
        return tok.encode_chat(plain_messages(messages), add_generation_prompt=True)
    except (ValueError, RecursionError) as e:  # the tokenizer's own message checks: list, roles, str contents
        raise BadRequest(f"'messages': {str(e)[:300]}", "messages") from e


def text_prompt(prompt, tok: Tokenizer) -> list[int]:
    # /v1/completions' prompt: a string, or a list of one (lm-evaluation-harness sends its batch of one so),
    # tokenized as it is: no chat template, and a special token's name in it is plain text.
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(x, (int, list)) for x in prompt):
        fix = "send the text, not token ids (lm-evaluation-harness: tokenized_requests=False)"
    elif isinstance(prompt, list) and len(prompt) > 1:
        fix = "send one prompt per request"
    else:
        fix = "send a non-empty string"
    raise BadRequest(f"'prompt' must be a non-empty string or a list of one, got {json.dumps(prompt)[:60]}; {fix}",
                     "prompt")


def fit_context(prompt: list[int], max_tokens: int | None, limit: str, default: int, max_len: int,
                field: str) -> int:
    # The prompt's new-token budget: as asked (limit names the field), or without one the server's
    # default, cut to what the context leaves; either must fit the context. field: the prompt's own.
    what = f"the {field} take{'s' if field == 'prompt' else ''} {len(prompt)} tokens"
    if max_tokens is None:
        if len(prompt) >= max_len:
            raise BadRequest(f"{what}: with one new token that is more than this server's context of {max_len} "
                             f"tokens; shorten the {field}", field, "context_length_exceeded")
        max_tokens = min(default, max_len - len(prompt))
    if len(prompt) + max_tokens > max_len:
        raise BadRequest(f"{what} and {limit} is {max_tokens}: together more than this server's context of "
                         f"{max_len} tokens; shorten the {field} or lower {limit}", field, "context_length_exceeded")
    return max_tokens


# ---- the endpoint: the OpenAI routes on http_server's hardened HTTP ----

class Server(http_server.Server):
    # The HTTP server of one engine; close() stops both.
    def __init__(self, engine: Engine, host: str, port: int, name: str, quiet: bool):
        self.engine, self.name = engine, name
        self.answering: set[Request] = set()  # requests whose HTTP thread has not finished its reply
        s = engine.s
        limits = Limits(s.timeout, s.max_connections, frozenset(s.allowed_hosts), s.api_key)
        super().__init__(host, port, Handler, limits, quiet)

    def close(self) -> None:
        super().close()
        self.engine.stop()

    def drain(self, seconds: float) -> None:
        # SIGTERM, SIGINT: no new connection (the listening socket closes) and no new request (503); the
        # running and queued requests have `seconds` to finish, then the engine stops and each one left
        # ends with an error event (a stream's last chunk, then [DONE]); then every connection closes.
        self.shutdown()
        self.server_close()
        engine, due = self.engine, time.monotonic() + seconds
        with engine.lock:
            engine.draining = True
        while time.monotonic() < due:
            with engine.lock:
                if not engine.running() and not engine.waiting:
                    break
            time.sleep(http_server.POLL_S)
        engine.stop()
        due = time.monotonic() + engine.s.timeout  # the HTTP threads write their last events
        while self.answering and time.monotonic() < due:
            time.sleep(http_server.POLL_S)
        http_server.Server.close(self)


class Handler(http_server.Handler):
    server: Server

    @property
    def routes(self) -> dict[str, str]:  # and the one model's own entry, as OpenAI's GET /v1/models/{model}:
        name = self.server.name  # as clients send it, ':' and '/' as they are or percent-encoded
        return {**ROUTES, **{f"/v1/models/{n}": "GET" for n in (name, quote(name), quote(name, safe=""))}}

    def get(self, path: str) -> None:
        engine = self.server.engine
        model = {"id": self.server.name, "object": "model", "created": 0, "owned_by": "mars",
                 "max_model_len": engine.max_len}
        if path == "/health":
            self.send_json(200, {"status": "ok"})
        elif path == "/metrics":
            self.send_json(200, engine.metrics())
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [model]})
        else:
            self.send_json(200, model)

    def post(self, path: str, body: bytes) -> None:  # /v1/chat/completions or /v1/completions
        engine, chat = self.server.engine, path == "/v1/chat/completions"
        try:
            r = parse_request(body, engine.tok, engine.s, engine.max_len, chat, self.server.name)
            engine.submit(r)
        except UnknownModel as e:
            return self.send_error_json(404, str(e), "invalid_request_error", e.param, e.code)
        except BadRequest as e:
            return self.send_error_json(400, str(e), "invalid_request_error", e.param, e.code)
        except Busy as e:
            return self.send_error_json(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
        except Draining as e:
            self.close_connection = True
            return self.send_error_json(503, str(e), "server_error", code="shutting_down")
        except Exception:  # a bug, not the client's fault: log it and answer, never drop the connection
            traceback.print_exc()
            return self.send_error_json(500, "the server failed to read this request; see its log", "server_error")
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.server.name}
        self.server.answering.add(r)
        try:
            if r.stream:
                self.stream(r, head, chat)
            else:
                self.answer(r, head, chat)
        except OSError:  # the client left while we wrote (reset, broken pipe, or a write that timed out)
            self.close_connection = True
            engine.cancel(r)
        finally:
            self.server.answering.discard(r)

    def next_event(self, r: Request) -> str | dict | None:
        # r's next event from the engine; None once the client hung up, which frees its row or queue place.
        if (event := self.wait(r.events)) is None:
            self.server.engine.cancel(r)
        return event

    def answer(self, r: Request, head: dict, chat: bool) -> None:
        parts = []
        while isinstance(event := self.next_event(r), str):
            parts.append(event)
        if event is None:
            return
        if "error" in event:
            return self.send_error_json(500, event["error"], "server_error")
        text = {"message": {"role": "assistant", "content": "".join(parts)}} if chat else {"text": "".join(parts)}
        choice = {"index": 0, **text, "finish_reason": event["finish_reason"], "logprobs": None}
        self.send_json(200, {**head, "choices": [choice], "usage": event["usage"], "mars": event["mars"]})

    def stream(self, r: Request, head: dict, chat: bool) -> None:
        # Server-sent events in OpenAI's chunk format (chat: deltas; completions: text); the last chunk
        # carries finish_reason, usage and the MARS stats, then `data: [DONE]`. Asked for with
        # stream_options.include_usage, usage and the stats come as OpenAI sends them: in a chunk of their own
        # after it, with no choices. The stream ends by closing the connection.
        def send(choice: dict | None, finish: str | None = None, **extra) -> None:
            choices = [] if choice is None else [{"index": 0, **choice, "finish_reason": finish, "logprobs": None}]
            chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": choices,
                     **extra}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

        text = (lambda t: {"delta": {"content": t}}) if chat else (lambda t: {"text": t})

        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        if chat:
            send({"delta": {"role": "assistant", "content": ""}})
        while isinstance(event := self.next_event(r), str):
            send(text(event))
        if event is None:
            return
        if "error" in event:
            error = error_body(event["error"], "server_error")
            self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
        elif r.usage_chunk:
            send({"delta": {}} if chat else {"text": ""}, event["finish_reason"], usage=None)
            send(None, usage=event["usage"], mars=event["mars"])
        else:
            send({"delta": {}} if chat else {"text": ""}, event["finish_reason"], usage=event["usage"],
                 mars=event["mars"])
        self.wfile.write(b"data: [DONE]\n\n")


def start(engine: Engine, host: str = "127.0.0.1", port: int = 0, name: str = "mars",
          quiet: bool = True, engine_thread: bool = True) -> Server:
    # Starts the HTTP server in a daemon thread, and the engine in a thread of its own unless the caller
    # runs engine.run() itself (main(): the thread that loaded the model); server.close() stops both.
    server = Server(engine, host, port, name, quiet)
    if engine_thread:
        engine.thread.start()
    threading.Thread(target=server.serve_forever, name="mars-http", daemon=True).start()
    return server


# ---- the command line ----

@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id (owner/name) or alias (qwen2.5-0.5b, qwen2.5-7b)
    host: str = "127.0.0.1"  # bind address; loopback by default, put a real proxy in front to expose it
    port: int = 8000  # 0 = any free port (printed at start)
    max_rows: int = 8  # rows decoded together (KV-cache slots); more requests wait in the queue
    max_queue: int = 32  # requests waiting for a free row; one more gets 429
    max_len: int = 2048  # prompt + max_tokens per request (capped by the model's context); sizes the cache
    max_tokens: int = 256  # max_tokens of a request that gives none
    tau_max: float = 1.0  # tau while rows are free; 1.0 = exact greedy AR
    verify: bool = True  # where the policy's tau is 1.0, rows self-verify (docs/method.md §9): the same tokens, faster
    tau_min: float = 1.0  # tau once every row is busy or requests queue; < 1 allows the lossy threshold rule under load
    draft_budget: str = "auto"  # verify rows' drafts and masks per row: auto = sized to the batch each step from the
    # cost of a forward measured at launch; N = fixed; 0 = the full tree
    block_size: int = 0  # B: slots per step; 0 = the B the checkpoint was trained with (its settings.json), else 4
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on cuda or --quantize, else fp32
    # (fp32 for --quantize int4 on the kernel's AVX2 build, which works in fp32)
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    quantize: Literal["none", "int8", "int4", "int4-torch"] = "none"  # weight-only linears, head (mars/quantize.py);
    # verify then gives exactly the quantized model's greedy tokens, which may differ from the float model's
    compile: bool = False  # torch.compile the decode steps at static shapes (mars/compiled.py; CUDA graphs on cuda)
    seed: int = 0  # seeds the generators of sampled requests (temperature > 0) that give no "seed"
    name: str = ""  # model name in responses and /v1/models; empty = the checkpoint folder's name, or a hub id as given
    quiet: bool = False  # do not log each HTTP request to stderr
    timeout: float = 10.0  # seconds a connection has to send a whole request; also its idle and write timeout
    max_connections: int = 128  # open connections (one thread each); one more gets 503 at once
    api_key: str = ""  # require "Authorization: Bearer KEY" (all but /health); empty = env MARS_API_KEY, else none
    allowed_hosts: list[str] = field(default_factory=list)  # Host names accepted besides localhost and --host; * = any
    drain_seconds: float = 5.0  # on SIGTERM or SIGINT: how long running requests may finish before they are cut


def check_settings(s: Settings) -> None:
    # Everything the flags alone show to be wrong (a usage error: cli.parse exits with status 2).
    if not 0.0 <= s.tau_min <= s.tau_max <= 1.0:
        raise ValueError(f"--tau-min {s.tau_min} and --tau-max {s.tau_max}: need 0 <= tau-min <= tau-max <= 1")
    check_block_size(s.block_size)
    if s.draft_budget != "auto" and not (s.draft_budget.isdigit() and s.draft_budget.isascii()):
        raise ValueError(f"--draft-budget {s.draft_budget}: auto, or positions per row (0 = the full tree)")
    for name in ("max_rows", "max_len", "max_tokens", "max_connections"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.max_queue < 0:
        raise ValueError(f"--max-queue {s.max_queue} must be at least 0")
    if not 0 <= s.port < 65536:
        raise ValueError(f"--port {s.port} in 0..65535 is needed (0: any free port)")
    if not 0 < s.timeout < float("inf"):
        raise ValueError(f"--timeout {s.timeout} must be a number of seconds > 0")
    if not 0 <= s.drain_seconds < float("inf"):
        raise ValueError(f"--drain-seconds {s.drain_seconds} must be a number of seconds >= 0")
    quantize.check(s.quantize, *device_and_dtype(s.device, s.dtype, s.quantize))


def served_name(ckpt: str) -> str:
    # A local checkpoint serves under its folder's name; a hub id or alias as given (Qwen/Qwen2.5-0.5B-Instruct,
    # the name vLLM serves it under and clients send).
    return Path(ckpt).resolve().name if Path(ckpt).is_dir() else ckpt


def launch(s: Settings, engine_thread: bool = True) -> Server:
    # Checkpoint -> a running server (without engine_thread, the caller runs server.engine.run()).
    # Raises ValueError or OSError for bad files and a port in use.
    if not s.api_key and os.environ.get("MARS_API_KEY"):
        s = replace(s, api_key=os.environ["MARS_API_KEY"])
    path, config = check_checkpoint(s.ckpt)
    if s.port:  # a busy port or a wrong host, said before minutes of loading rather than after
        try:
            socket.create_server((s.host, s.port)).close()
        except OSError as e:
            raise OSError(cannot_listen(s, e)) from e
    s = replace(s, block_size=trained_block_size(path, s.block_size))
    tok = Tokenizer.from_pretrained(path)
    device, dtype = device_and_dtype(s.device, s.dtype, s.quantize)
    if s.compile:
        from mars import compiled
        compiled.check_compiler(device)
    check_mask_row(path, config, tok, "serve.py (a request may self-verify or take a threshold below 1)")
    warn_untrained_masks(str(path), s.tau_min)
    model = load_model(path, device, dtype, quantize=s.quantize)
    check_cache_memory(model, s)
    shown = {**asdict(s), "api_key": "(set)" if s.api_key else ""}  # never a secret in the log
    print({**shown, "device": device, "dtype": str(dtype)}, file=sys.stderr)
    if warning := exposure_warning(s.host, s.api_key):
        print(warning, file=sys.stderr)
    if s.draft_budget == "auto":  # the engine first times forwards: many seconds of silence otherwise
        print(f"measuring the draft budget on this machine (about {max(1, round(measuring_seconds(model, s)))} s)...",
              file=sys.stderr)
    t0 = time.monotonic()
    engine = Engine(model, tok, s)
    if engine.policy:
        start_at = ", ".join(f"{R}: {engine.policy.budget(R)}" for R in range(1, s.max_rows + 1))
        print(f"measured in {time.monotonic() - t0:.0f} s; starting draft budget per row, by rows in the step (then "
              f"moved by measured speed): {start_at}", file=sys.stderr)
    if s.compile:
        print(f"compiling the decode step at widths {', '.join(map(str, engine.widths()))}, once, before "
              "serving...", file=sys.stderr)
        t0 = time.monotonic()
        engine.warm()
        print(f"compiled in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    try:
        return start(engine, s.host, s.port, s.name or served_name(s.ckpt), s.quiet, engine_thread)
    except OSError as e:
        raise OSError(cannot_listen(s, e)) from e


def cannot_listen(s: Settings, e: OSError) -> str:
    # The fix depends on which half of host:port is wrong.
    if e.errno in (errno.EADDRINUSE, errno.EACCES):
        fix = "pick another --port" + (" (below 1024 needs root)" if e.errno == errno.EACCES else "")
    else:  # no such name, or an address this machine does not have
        fix = "check --host: a name or address of this machine (127.0.0.1, or 0.0.0.0 for every interface)"
    return f"cannot listen on {s.host}:{s.port}: {e.strerror or e}; {fix}"


def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line and exit status 2 (cli.parse). Bad files, a busy port: one line naming the
    # file and the fix, exit status 1. Anything else is a bug and keeps its traceback.
    s = cli.parse(Settings, argv, "OpenAI-compatible MARS server with continuous batching.", check=check_settings)
    try:
        server = launch(s, engine_thread=False)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C while it loads, measures or compiles (once serving, it drains: below)
        print("\ninterrupted before serving", file=sys.stderr)
        raise SystemExit(130) from None
    # SIGTERM (a supervisor) and SIGINT (Ctrl-C) drain the server, from a thread of their own: this one
    # runs the engine. The handlers are in place before the line below says where it serves: a signal sent
    # after that line drains it, never kills it mid-stream.
    stopping, drained = threading.Event(), threading.Event()

    def drain() -> None:
        print(f"draining: running requests have {s.drain_seconds:g} s to finish (--drain-seconds)", file=sys.stderr)
        server.drain(s.drain_seconds)
        drained.set()

    def on_signal(*_) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=drain, name="mars-drain", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(f"serving {server.name} on {server.url} (POST /v1/chat/completions and /v1/completions, GET /metrics)",
          file=sys.stderr)
    server.engine.run()  # in the thread that loaded the model and measured it: one CPU thread pool
    drained.wait()
    print("stopped", file=sys.stderr)
    # Every request is answered and every connection closed. The interpreter's own teardown took 6 s more
    # on a loaded 2-core machine (0.5 s for all of the above): the process ends here.
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
