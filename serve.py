# An OpenAI-compatible chat server for MARS with continuous batching (MARS.md §6-§8).
#
# One engine thread owns the model and a cursor KV cache with --max-rows row slots. Each step it
# drops rows whose client went away, admits waiting requests into free slots, runs one
# generate.decode_step over all slots (a free slot feeds pads and commits nothing), commits each
# busy row's real tokens, and hands the new text to the request's HTTP thread through a queue. A
# request joins at the next step and leaves at the step it finishes: nobody waits for the slowest row.
#
# tau is per row and per step, so it becomes a live speed knob (§8): exact AR quality (--tau-max 1.0)
# while rows are free, more tokens per forward (down to --tau-min) as they fill. See load_tau().
#
#   python serve.py --ckpt runs/demo/mars --port 8000
#   curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
from __future__ import annotations

import contextlib
import json
import queue
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import torch

import cli
from generate import DEFAULT_CKPT, check_checkpoint, decode_step, device_and_dtype, window
from kvcache import KVCache
from model import Transformer
from tokenizer import Tokenizer

WINDOW_S = 10.0  # /metrics reports tokens/s and tokens per forward over this many recent seconds
MAX_BODY = 1 << 20  # bytes; a longer request body is refused without being read


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
    tau_min: float = 0.7  # tau once every row is busy or requests queue
    block_size: int = 4  # B: slots per step, the window the model was trained with
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    seed: int = 0  # seeds the sampling generator (requests with temperature > 0)
    name: str = ""  # model name in responses and /v1/models; empty = the checkpoint folder's name
    quiet: bool = False  # do not log each HTTP request to stderr


def load_tau(running: int, queued: int, max_rows: int, tau_max: float, tau_min: float) -> float:
    # The load policy: load = (running rows + queued requests) / max_rows, then
    #   tau = tau_max - (tau_max - tau_min) * clamp(2 * load - 1, 0, 1).
    # Up to half the rows busy the batch has spare width, so rows decode at tau_max (exact AR at 1.0).
    # From half to all rows busy tau falls linearly; once every row is busy or a queue forms it stays at
    # tau_min, where a row takes the most tokens per forward, finishes soonest and frees its slot.
    x = min(max(2 * (running + queued) / max_rows - 1, 0.0), 1.0)
    return round(tau_max - (tau_max - tau_min) * x, 6)


# ---- requests: parsed and checked in the HTTP thread, decoded in the engine thread ----

class BadRequest(Exception):  # -> 400 with an OpenAI-style error body
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class Busy(Exception):  # -> 429: every row is busy and the queue is full
    pass


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    temperature: float  # 0 = greedy, the paper's setting (and our default, unlike OpenAI's 1.0)
    stop: list[str]  # strings that end the output; the text is cut before the first one
    threshold: float | None  # the request's own tau; None = the server's load policy
    stream: bool
    events: queue.Queue = field(default_factory=queue.Queue)  # engine -> HTTP thread: str deltas, then a dict
    cancelled: bool = False  # set by the HTTP thread when its client went away; the engine frees the row
    out: list[int] = field(default_factory=list)  # accepted tokens, stop token included
    shown: int = 0  # characters of the output text already put on `events`
    forwards: int = 0  # steps this row took part in (the prompt's counts, §6)
    tau: float = 1.0  # tau of the row's last step
    tau_low: float = 1.0  # lowest tau any of its steps used


def parse_request(raw: bytes, tok: Tokenizer, s: Settings, max_len: int) -> Request:
    # The body of POST /v1/chat/completions -> a Request; anything wrong -> BadRequest naming the field.
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise BadRequest("missing required field 'messages': a list of {'role', 'content'} objects",
                         "messages")

    def get(name: str, kind: type, default, ok=lambda v: True, want: str = ""):
        v = body.get(name)
        if v is None:  # absent, or null as some clients send for "unset"
            return default
        if kind is float and type(v) is int:
            v = float(v)
        if type(v) is not kind or not ok(v):  # type(), not isinstance: True is not a number here
            raise BadRequest(f"'{name}' must be {want or kind.__name__}, got {json.dumps(v)[:60]}", name)
        return v

    temperature = get("temperature", float, 0.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")
    threshold = get("threshold", float, None, lambda v: 0 <= v <= 1, "a number in [0, 1] (MARS tau)")
    stream = get("stream", bool, False)
    get("n", int, 1, lambda v: v == 1, "1 (one choice per request)")
    get("top_p", float, 1.0, lambda v: v == 1, "1 (no nucleus sampling here; use temperature)")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest(f"'stop' must be a string or a list of up to 4 non-empty strings, got "
                         f"{json.dumps(body['stop'])[:60]}", "stop")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get(limit, int, None, lambda v: v >= 1, "an integer >= 1")
    try:
        prompt = tok.encode_chat(body["messages"], add_generation_prompt=True)
    except ValueError as e:  # the tokenizer's own message checks: list, roles, str contents
        raise BadRequest(f"'messages': {e}", "messages") from e
    max_tokens = max_tokens or max(1, min(s.max_tokens, max_len - len(prompt)))
    if len(prompt) + max_tokens > max_len:
        raise BadRequest(f"the messages take {len(prompt)} tokens and {limit} is {max_tokens}: together "
                         f"more than this server's context of {max_len} tokens; shorten the messages or "
                         f"lower {limit}", "messages", "context_length_exceeded")
    return Request(prompt, max_tokens, temperature, stop, threshold, stream)


def held_back(text: str, stops: list[str]) -> int:
    # Characters at the end of text that must not be streamed yet: an unfinished UTF-8 character
    # (decoded as U+FFFD until its last byte arrives), and before it the start of a possible stop string.
    done = text.rstrip("\ufffd")
    n = max((k for x in stops for k in range(1, len(x)) if done.endswith(x[:k])), default=0)
    return len(text) - len(done) + n


# ---- the engine: one thread, one model, one cache, continuous batching ----

class Engine:
    def __init__(self, model: Transformer, tok: Tokenizer, s: Settings):
        self.model, self.tok, self.s = model, tok, s
        self.max_len = min(s.max_len, model.config.max_position_embeddings)
        device = model.model.embed_tokens.weight.device
        # A step writes max(len of every row's fed tokens) columns at each row's length: a joining
        # prompt (< max_len) next to a row near the end (< max_len) needs up to 2 * max_len + B.
        self.kv = KVCache(model.config, s.max_rows, 2 * self.max_len + s.block_size, device,
                          model.model.embed_tokens.weight.dtype)
        self.generator = torch.Generator(device=device).manual_seed(s.seed)
        self.rows: list[Request | None] = [None] * s.max_rows  # slot -> its request; only run() writes it
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()  # guards rows, waiting, the counters; wakes an idle engine
        self.recent: deque[tuple[float, int, int]] = deque()  # (time, tokens, row steps) per step
        self.totals = dict(requests=0, finished=0, cancelled=0, rejected=0, failed=0, tokens=0, steps=0)
        self.started, self.stopped = time.monotonic(), False
        self.thread = threading.Thread(target=self.run, name="mars-engine", daemon=True)

    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def submit(self, r: Request) -> None:
        with self.lock:
            if self.running() + len(self.waiting) >= self.s.max_rows + self.s.max_queue:
                self.totals["rejected"] += 1
                raise Busy(f"server is full: {self.running()} rows running and {len(self.waiting)} requests "
                           f"queued (--max-rows {self.s.max_rows}, --max-queue {self.s.max_queue}); retry later")
            self.waiting.append(r)
            self.totals["requests"] += 1
            self.lock.notify()

    def run(self) -> None:
        with torch.inference_mode():  # thread-local: it must be entered in the engine's own thread
            while True:
                with self.lock:
                    self.admit()
                    while not self.running() and not self.stopped:
                        self.lock.wait()
                        self.admit()
                    if self.stopped:
                        return
                try:
                    self.step()
                except Exception:  # fail this step's requests, keep serving the next ones
                    traceback.print_exc()
                    with self.lock:
                        for b, r in enumerate(self.rows):
                            if r is not None:
                                self.free(b, "failed")
                                r.events.put({"error": "the engine failed on this step; see the server log"})

    def admit(self) -> None:
        # Under the lock, between steps: free rows whose client left, then fill free slots in FIFO order.
        for b, r in enumerate(self.rows):
            if r is not None and r.cancelled:
                self.free(b, "cancelled")
        while self.waiting and None in self.rows:
            r = self.waiting.popleft()
            if r.cancelled:
                self.totals["cancelled"] += 1
            else:
                self.rows[self.rows.index(None)] = r

    def free(self, b: int, outcome: str) -> None:
        # The slot's committed length goes back to 0: the next request in it starts from an empty cache
        # and, by causality, can never attend to the old request's columns.
        self.rows[b] = None
        self.kv.truncate([0 if i == b else n for i, n in enumerate(self.kv.lengths)])
        self.totals[outcome] += 1

    def step(self) -> None:
        s, rows = self.s, list(self.rows)
        with self.lock:
            tau = load_tau(self.running(), len(self.waiting), s.max_rows, s.tau_max, s.tau_min)
        taus = [tau if r is None or r.threshold is None else r.threshold for r in rows]
        w = [window(len(r.out), s.block_size, r.max_tokens, 0) if r else 0 for r in rows]  # 0 = free slot
        new, fed = decode_step(self.model, [r.prompt + r.out if r else [] for r in rows], w, self.tok.mask_id,
                               self.tok.stop_ids, taus, self.kv, [r.temperature if r else 0.0 for r in rows],
                               generator=self.generator, vocab_size=self.tok.vocab_size)
        self.kv.commit(fed)  # cursor cache (§7): every busy row keeps all the real tokens it fed
        with self.lock:
            for b, r in enumerate(rows):
                if r is not None:
                    r.out += new[b]
                    r.forwards += 1
                    r.tau, r.tau_low = taus[b], min(taus[b], r.tau_low)
                    self.emit(b, r)
            tokens = sum(map(len, new))
            self.recent.append((time.monotonic(), tokens, sum(x > 0 for x in w)))
            self.totals["tokens"] += tokens
            self.totals["steps"] += 1

    def emit(self, b: int, r: Request) -> None:
        # Sends the text that is now certain; finishes the row at a stop token, a stop string or max_tokens.
        stop_ids = self.tok.stop_ids
        text = self.tok.decode([t for t in r.out if t not in stop_ids])
        finish = "stop" if r.out[-1] in stop_ids else None
        cut = min((i for i in map(text.find, r.stop) if i >= 0), default=-1)
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
            r.events.put({"finish_reason": finish,
                          "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": n,
                                    "total_tokens": len(r.prompt) + n},
                          "mars": {"forwards": r.forwards, "tokens_per_forward": round(n / r.forwards, 4),
                                   "threshold": r.tau, "threshold_min": r.tau_low}})

    def metrics(self) -> dict:
        with self.lock:
            now = time.monotonic()
            while self.recent and self.recent[0][0] < now - WINDOW_S:
                self.recent.popleft()
            tokens, row_steps = sum(t for _, t, _ in self.recent), sum(n for _, _, n in self.recent)
            running, queued = self.running(), len(self.waiting)
            return {"queue_depth": queued, "running_rows": running, "max_rows": self.s.max_rows,
                    "max_queue": self.s.max_queue,
                    "tau": load_tau(running, queued, self.s.max_rows, self.s.tau_max, self.s.tau_min),
                    "window_s": WINDOW_S,
                    "tokens_per_second": round(tokens / max(min(WINDOW_S, now - self.started), 1e-3), 2),
                    # per sequence, as in the paper: accepted tokens / (row, forward) pairs
                    "tokens_per_forward": round(tokens / row_steps, 4) if row_steps else None,
                    "totals": dict(self.totals)}

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join()
        for r in [*filter(None, self.rows), *self.waiting]:  # no HTTP thread waits forever
            r.events.put({"error": "the server is shutting down"})


# ---- HTTP: one thread per connection, the OpenAI wire format ----

class Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung client never blocks shutdown
    request_queue_size = 128  # listen backlog; the default 5 drops bursts of connects (a 1 s SYN retry)

    def __init__(self, engine: Engine, host: str, port: int, name: str, quiet: bool):
        self.engine, self.name, self.quiet = engine, name, quiet
        self.connections: set[socket.socket] = set()  # open client connections, closed by close()
        super().__init__((host, port), Handler)

    def process_request(self, request, client_address) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is no server error
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        for conn in list(self.connections):  # wakes the threads waiting on idle keep-alive connections
            with contextlib.suppress(OSError):  # it may have closed meanwhile
                conn.shutdown(socket.SHUT_RDWR)
        self.engine.stop()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every reply has a Content-Length except streams
    server: Server

    def log_message(self, format: str, *args) -> None:
        if not self.server.quiet:
            super().log_message(format, *args)

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, status: int, message: str, kind: str, param: str | None = None,
                        code: str | None = None) -> None:
        self.send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}})

    def do_GET(self) -> None:
        path, engine = urlsplit(self.path).path, self.server.engine
        if path == "/health":
            self.send_json(200, {"status": "ok"})
        elif path == "/metrics":
            self.send_json(200, engine.metrics())
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": self.server.name, "object": "model", "created": 0, "owned_by": "mars",
                 "max_model_len": engine.max_len}]})
        else:
            self.send_error_json(404, f"no route GET {path}", "invalid_request_error", code="not_found")

    def do_POST(self) -> None:
        path, engine = urlsplit(self.path).path, self.server.engine
        try:  # a chunked body has no length to check in advance: refused like a bad length
            size = -1 if "Transfer-Encoding" in self.headers else int(self.headers.get("Content-Length") or 0)
        except ValueError:
            size = -1
        if not 0 <= size <= MAX_BODY:
            self.close_connection = True  # the body was not read: the connection cannot be reused
            return self.send_error_json(413 if size > 0 else 400, f"the body needs a Content-Length of 0.."
                                        f"{MAX_BODY} bytes", "invalid_request_error")
        raw = self.rfile.read(size)
        if path != "/v1/chat/completions":
            return self.send_error_json(404, f"no route POST {path}", "invalid_request_error", code="not_found")
        try:
            r = parse_request(raw, engine.tok, engine.s, engine.max_len)
            engine.submit(r)
        except BadRequest as e:
            return self.send_error_json(400, str(e), "invalid_request_error", e.param, e.code)
        except Busy as e:
            return self.send_error_json(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.server.name}
        if r.stream:
            self.stream(r, head)
        else:
            parts = []
            while isinstance(ev := r.events.get(), str):
                parts.append(ev)
            if "error" in ev:
                return self.send_error_json(500, ev["error"], "server_error")
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                      "finish_reason": ev["finish_reason"], "logprobs": None}
            self.send_json(200, {"object": "chat.completion", **head, "choices": [choice], "usage": ev["usage"],
                                 "mars": ev["mars"]})

    def stream(self, r: Request, head: dict) -> None:
        # Server-sent events in OpenAI's chunk format; the last chunk carries finish_reason, usage and
        # the MARS stats, then `data: [DONE]`. The stream ends by closing the connection.
        def send(delta: dict, finish: str | None = None, **extra) -> None:
            chunk = {"object": "chat.completion.chunk", **head,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            send({"role": "assistant", "content": ""})
            while isinstance(ev := r.events.get(), str):
                send({"content": ev})
            if "error" in ev:
                error = {"error": {"message": ev["error"], "type": "server_error", "param": None, "code": None}}
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
            else:
                send({}, ev["finish_reason"], usage=ev["usage"], mars=ev["mars"])
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client left: free its row at the next step
            r.cancelled = True


def start(engine: Engine, host: str = "127.0.0.1", port: int = 0, name: str = "mars",
          quiet: bool = True) -> Server:
    # Starts the engine thread and the HTTP server in a daemon thread; server.close() stops both.
    server = Server(engine, host, port, name, quiet)
    engine.thread.start()
    threading.Thread(target=server.serve_forever, name="mars-http", daemon=True).start()
    return server


def check_settings(s: Settings) -> None:
    if not 0.0 <= s.tau_min <= s.tau_max <= 1.0:
        raise ValueError(f"--tau-min {s.tau_min} and --tau-max {s.tau_max}: need 0 <= tau-min <= tau-max <= 1")
    for name in ("max_rows", "max_len", "max_tokens", "block_size"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.max_queue < 0 or not 0 <= s.port < 65536:
        raise ValueError(f"--max-queue {s.max_queue} must be >= 0 and --port {s.port} in 0..65535")
    device_and_dtype(s.device, s.dtype)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "OpenAI-compatible MARS server with continuous batching.")
    try:
        check_settings(s)
        path, _ = check_checkpoint(s.ckpt)
        tok = Tokenizer.from_pretrained(path)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    device, dtype = device_and_dtype(s.device, s.dtype)
    model = Transformer.from_pretrained(path, device=device, dtype=dtype).eval()
    print({**asdict(s), "device": device, "dtype": str(dtype)}, file=sys.stderr)
    try:
        server = start(Engine(model, tok, s), s.host, s.port, s.name or Path(s.ckpt).resolve().name, s.quiet)
    except OSError as e:
        sys.exit(f"error: cannot listen on {s.host}:{s.port}: {e.strerror}; pick another --port")
    print(f"serving {server.name} on {server.url} (POST /v1/chat/completions, GET /metrics)", file=sys.stderr)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
