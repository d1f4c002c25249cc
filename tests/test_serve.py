# serve.py: the OpenAI-compatible server with continuous batching. A tiny random checkpoint is served
# on a loopback port inside the test and driven by the real `openai` client and by raw HTTP; every
# output must equal generate.decode run on the same prompt alone.
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest
import torch

import serve
from generate import decode
from model import Config, Transformer
from tokenizer import Tokenizer

B = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Byte-level tokenizer, random weights with a sharpened embedding (as tests/test_generate.py's
    # tiny()): confidences spread over (0, 1), so thresholds between 0.5 and 0.9 change the output.
    torch.manual_seed(0)
    tok = Tokenizer.byte_level()
    config = Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                    max_position_embeddings=512, torch_dtype="float32", eos_token_id=tok.eos_id)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        model.model.embed_tokens.weight.mul_(3.0)
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


def start(path, step_s: float = 0.0, **settings) -> serve.Server:
    # A server on an ephemeral loopback port with its own copy of the model; step_s slows every
    # forward down, so a test can catch rows mid-flight.
    s = serve.Settings(ckpt=str(path), port=0, max_len=512, max_tokens=32, tau_min=0.5, **settings)
    model = Transformer.from_pretrained(path).eval()
    if step_s:
        hidden = model.hidden
        model.hidden = lambda *a, **kw: time.sleep(step_s) or hidden(*a, **kw)
    return serve.start(serve.Engine(model, Tokenizer.from_pretrained(path), s), name="tiny")


@pytest.fixture(scope="module")
def server(ckpt):
    server = start(ckpt[0], max_rows=4, max_queue=16)
    yield server
    server.close()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reference(ckpt, text: str, tau: float, max_tokens: int) -> tuple[str, list[int], int]:
    # generate.py on the prompt alone: (text without the stop token, tokens, forwards)
    _, model, tok = ckpt
    prompt = tok.encode_chat(chat(text), add_generation_prompt=True)
    out, forwards = decode(model, [prompt], tok.mask_id, tok.stop_ids, tau=tau, B=B, max_new_tokens=max_tokens,
                           cache="none", vocab_size=tok.vocab_size)
    return tok.decode([t for t in out[0] if t not in tok.stop_ids]), out[0], forwards[0]


def fetch(server, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*urlsplit(server.url).netloc.split(":"), timeout=30)
    conn.request(method, path, body=json.dumps(body) if isinstance(body, dict) else body,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    status, data = r.status, json.loads(r.read())
    conn.close()
    return status, data


def ask(server, text: str, max_tokens: int, **fields) -> tuple[int, dict]:
    body = {"messages": chat(text), "max_tokens": max_tokens, **fields}
    return fetch(server, "POST", "/v1/chat/completions", body)


def content(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def sse(server, body: dict) -> list[str]:
    # Raw streaming request -> the `data:` payloads, in order.
    conn = http.client.HTTPConnection(*urlsplit(server.url).netloc.split(":"), timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}))
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    lines = [line for line in r.read().decode().split("\n\n") if line]
    conn.close()
    assert all(line.startswith("data: ") for line in lines)
    return [line[len("data: "):] for line in lines]


def wait_for(server, **want) -> dict:
    # Polls /metrics until every key has the wanted value (or fails after 10 s).
    for _ in range(1000):
        m = fetch(server, "GET", "/metrics")[1]
        if all(m[k] == v for k, v in want.items()):
            return m
        time.sleep(0.01)
    pytest.fail(f"/metrics never reached {want}: {m}")


# ---- the load policy ----

def test_load_tau_is_a_pure_function_of_load():
    tau = lambda running, queued: serve.load_tau(running, queued, 8, 1.0, 0.7)  # noqa: E731
    assert tau(0, 0) == tau(1, 0) == tau(4, 0) == 1.0  # up to half the rows busy: exact AR
    assert tau(5, 0) == 0.925 and tau(6, 0) == 0.85 and tau(7, 0) == 0.775  # linear in between
    assert tau(8, 0) == tau(8, 3) == tau(6, 2) == 0.7  # all rows busy, or a queue: tau_min
    assert tau(4, 2) == tau(6, 0)  # a queued request weighs as much as a running row
    rising_load = [tau(r, 0) for r in range(9)] + [tau(8, q) for q in range(1, 4)]
    assert rising_load == sorted(rising_load, reverse=True)  # more load never raises tau
    assert serve.load_tau(8, 8, 8, 0.9, 0.9) == 0.9  # tau_min = tau_max: a fixed tau


# ---- outputs equal generate.py ----

@pytest.mark.parametrize("tau", [1.0, 0.7, 0.5])
def test_greedy_output_equals_generate(server, ckpt, tau):
    tok = ckpt[2]
    for text in ["Hi", "tell me a story about a cat"]:
        want, out, forwards = reference(ckpt, text, tau, 24)
        r = client(server).chat.completions.create(model="tiny", messages=chat(text), max_tokens=24,
                                                   extra_body={"threshold": tau})
        assert r.choices[0].message.content == want
        assert r.choices[0].finish_reason == ("stop" if out[-1] in tok.stop_ids else "length")
        assert r.usage.completion_tokens == len(out) and r.usage.prompt_tokens == len(
            tok.encode_chat(chat(text), add_generation_prompt=True))
        assert r.mars == {"forwards": forwards, "tokens_per_forward": round(len(out) / forwards, 4),
                          "threshold": tau, "threshold_min": tau}
    if tau == 0.5:  # thresholds matter on this model: several tokens per forward
        assert forwards < len(out)


def test_idle_server_decodes_at_tau_max(server, ckpt):
    # No threshold in the request: the policy's tau, tau_max = 1.0 on an idle server, exact greedy AR;
    # with "verify": false the row decodes it one token per forward (with verify, see below).
    want, out, forwards = reference(ckpt, "What is 2+2?", 1.0, 20)
    status, r = ask(server, "What is 2+2?", 20, verify=False)
    assert status == 200 and content(r) == want
    assert r["mars"]["threshold"] == 1.0 and r["mars"]["forwards"] == len(out) == forwards


def verified(ckpt, text: str, max_tokens: int) -> tuple[int, list[int]]:
    # generate.py --verify on the prompt alone: (forwards, [drafts offered, accepted])
    _, model, tok = ckpt
    prompt, stats = tok.encode_chat(chat(text), add_generation_prompt=True), []
    _, forwards = decode(model, [prompt], tok.mask_id, tok.stop_ids, B=B, max_new_tokens=max_tokens,
                         vocab_size=tok.vocab_size, verify=True, draft_stats=stats)
    return forwards[0], stats[0]


@pytest.mark.parametrize("fields", [{}, {"verify": True}])
def test_verify_is_the_idle_default_and_a_request_field(server, ckpt, fields):
    # An idle server (tau 1.0 by the policy) self-verifies: the greedy text, with generate.py --verify's
    # forwards and drafts. "verify": true asks for it whatever the load (openai: extra_body).
    for text in ["What is 2+2?", "tell me a story about a cat"]:
        want, out, _ = reference(ckpt, text, 1.0, 24)
        forwards, (offered, accepted) = verified(ckpt, text, 24)
        r = client(server).chat.completions.create(model="tiny", messages=chat(text), max_tokens=24,
                                                   extra_body=fields)
        assert r.choices[0].message.content == want and r.usage.completion_tokens == len(out)
        assert r.mars == {"forwards": forwards, "tokens_per_forward": round(len(out) / forwards, 4),
                          "threshold": 1.0, "threshold_min": 1.0, "verify_steps": forwards,
                          "drafts_offered": offered, "drafts_accepted": accepted}
        assert offered > 0 and len(out) == forwards + accepted
    assert fetch(server, "GET", "/metrics")[1]["verify"] is True


def test_verify_rows_share_forwards_with_threshold_and_sampled_rows(ckpt):
    # Verify rows next to threshold rows, a sampled verify row, and rows on the load policy, which
    # seven requests for three rows push to the threshold: every pinned greedy output equals its
    # prompt decoded alone.
    server = start(ckpt[0], step_s=0.002, max_rows=3, max_queue=16)
    jobs = [("Hi", {"verify": True}, 30), ("a longer question about the weather?", {"threshold": 0.5}, 40),
            ("tell me a story", {}, 36), ("count to ten", {"verify": True}, 25), ("ok", {"threshold": 0.7}, 17),
            ("What is 2+2?", {"verify": True, "temperature": 1.5}, 20), ("x", {}, 12)]
    start_line = threading.Barrier(len(jobs))

    def one(job):
        text, fields, n = job
        start_line.wait()
        return ask(server, text, n, **fields)[1]

    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(one, jobs))
        for (text, fields, n), r in zip(jobs, got):
            if "temperature" in fields:
                assert r["mars"]["verify_steps"] == r["mars"]["forwards"] and len(content(r)) > 0
            if "temperature" in fields or not fields:  # sampled, or the policy's mode: depends on the timing
                continue
            assert content(r) == reference(ckpt, text, fields.get("threshold", 1.0), n)[0], text
            if fields.get("verify"):
                assert (r["mars"]["forwards"], [r["mars"][k] for k in ("drafts_offered", "drafts_accepted")]) \
                    == verified(ckpt, text, n), text
        policy = [r for (_, fields, _), r in zip(jobs, got) if not fields]
        assert any(r["mars"]["threshold_min"] < 1.0 for r in policy)  # the load moved them to the threshold
        m = wait_for(server, running_rows=0)
        assert m["totals"]["finished"] == len(jobs)
    finally:
        server.close()


def test_streaming_concatenates_to_the_non_streamed_text(server, ckpt):
    for tau in (1.0, 0.5):
        want, out, _ = reference(ckpt, "tell me a story", tau, 30)
        chunks = list(client(server).chat.completions.create(model="tiny", messages=chat("tell me a story"),
                                                             max_tokens=30, stream=True,
                                                             extra_body={"threshold": tau}))
        assert len(chunks) > 3 and chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 30
        # Raw SSE: the same chunks, then the terminator.
        events = sse(server, {"messages": chat("tell me a story"), "max_tokens": 30, "threshold": tau})
        assert events[-1] == "[DONE]"
        parsed = [json.loads(e) for e in events[:-1]]
        assert all(p["object"] == "chat.completion.chunk" for p in parsed)
        assert "".join(p["choices"][0]["delta"].get("content", "") for p in parsed) == want
        assert parsed[-1]["mars"]["threshold"] == tau


def test_concurrent_requests_each_get_their_own_output(ckpt):
    # More requests than rows, of different lengths and thresholds, all at once: each output equals
    # its prompt decoded alone, and rows really shared forwards (continuous batching).
    server = start(ckpt[0], step_s=0.002, max_rows=3, max_queue=16)
    jobs = [(text, tau, n) for text, tau, n in zip(
        ["Hi", "a longer question about the weather in Paris?", "x", "count to ten", "tell me a story",
         "What is 2+2?", "ok", "Write a poem about the sea, in four short lines."],
        [1.0, 0.5, 0.7, 0.9, 0.5, 1.0, 0.6, 0.8], [5, 40, 17, 30, 8, 23, 40, 12])]
    start_line = threading.Barrier(len(jobs))

    def one(job):
        text, tau, n = job
        start_line.wait()
        if len(text) % 2:  # half through the openai client, half through raw HTTP
            r = client(server).chat.completions.create(model="tiny", messages=chat(text), max_tokens=n,
                                                       extra_body={"threshold": tau})
            return r.choices[0].message.content, r.mars["forwards"]
        status, r = ask(server, text, n, threshold=tau)
        return content(r), r["mars"]["forwards"]

    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(one, jobs))
        for (text, tau, n), (output, forwards) in zip(jobs, got):
            assert (output, forwards) == reference(ckpt, text, tau, n)[::2], text
        m = wait_for(server, running_rows=0)
        assert m["totals"]["finished"] == len(jobs) and m["totals"]["steps"] < sum(f for _, f in got)
    finally:
        server.close()


def test_sampled_rows_do_not_disturb_greedy_rows(ckpt):
    # Rows sample at their own temperature in the same forward as greedy rows (generate.decode_step).
    server = start(ckpt[0], step_s=0.002, max_rows=4)
    try:
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda a: ask(server, "tell me a story", 30, temperature=a[0], threshold=a[1]),
                                 [(1.5, 0.5), (0.0, 0.5), (1.5, 1.0), (0.0, 1.0)]))
        texts = [content(r) for _, r in runs]
        assert texts[1] == reference(ckpt, "tell me a story", 0.5, 30)[0]
        assert texts[3] == reference(ckpt, "tell me a story", 1.0, 30)[0]
        assert texts[0] != texts[1] and texts[2] != texts[3]  # a temperature of 1.5 leaves the argmax path
    finally:
        server.close()


def test_stop_strings_cut_the_output_and_finish_the_row(server, ckpt):
    full, out, _ = reference(ckpt, "tell me a story", 0.5, 40)
    i = next(i for i in range(8, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stop = full[i:i + 2]
    r = client(server).chat.completions.create(model="tiny", messages=chat("tell me a story"), max_tokens=40,
                                               stop=[stop, "never appears"], extra_body={"threshold": 0.5})
    assert r.choices[0].message.content == full[:i] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    events = sse(server, {"messages": chat("tell me a story"), "max_tokens": 40, "stop": stop, "threshold": 0.5})
    parsed = [json.loads(e) for e in events[:-1]]
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in parsed) == full[:i]
    assert parsed[-1]["choices"][0]["finish_reason"] == "stop"


def test_streaming_holds_back_what_a_later_token_can_change():
    # Not yet sent: the start of a stop string, an unfinished UTF-8 character (U+FFFD for now), and a
    # stop string's start right before such a character ("Y" then the first bytes of "氰").
    assert serve.held_back("abc", ["xyz"]) == 0 and serve.held_back("abc", ["cd", "bcx"]) == 2
    assert serve.held_back("ab\ufffd\ufffd", []) == 2
    assert serve.held_back("aY\ufffd", ["Y氰"]) == 2 and serve.held_back("aY\ufffd", ["Z"]) == 1


# ---- robustness ----

@pytest.mark.parametrize("body,param,code", [
    (b"{not json", None, None),
    (b"", None, None),
    (b"[1, 2]", None, None),
    ({"max_tokens": 5}, "messages", None),
    ({"messages": "hi"}, "messages", None),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages", None),
    ({"messages": [{"role": "user", "content": 7}]}, "messages", None),
    ({"messages": chat("hi"), "max_tokens": "ten"}, "max_tokens", None),
    ({"messages": chat("hi"), "max_tokens": 0}, "max_tokens", None),
    ({"messages": chat("hi"), "max_tokens": True}, "max_tokens", None),
    ({"messages": chat("hi"), "temperature": "hot"}, "temperature", None),
    ({"messages": chat("hi"), "stream": "yes"}, "stream", None),
    ({"messages": chat("hi"), "stop": 5}, "stop", None),
    ({"messages": chat("hi"), "stop": [""]}, "stop", None),
    ({"messages": chat("hi"), "threshold": 1.5}, "threshold", None),
    ({"messages": chat("hi"), "verify": "yes"}, "verify", None),
    ({"messages": chat("hi"), "verify": True, "threshold": 0.9}, "verify", None),
    ({"messages": chat("hi"), "n": 2}, "n", None),
    ({"messages": chat("hi"), "top_p": 0.9}, "top_p", None),
    ({"messages": chat("x" * 600)}, "messages", "context_length_exceeded"),
    ({"messages": chat("hi"), "max_tokens": 500}, "messages", "context_length_exceeded"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, ckpt, body, param, code):
    status, r = fetch(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and set(r["error"]) == {"message", "type", "param", "code"}
    assert r["error"]["type"] == "invalid_request_error" and r["error"]["message"]
    assert (r["error"]["param"], r["error"]["code"]) == (param, code)
    assert fetch(server, "GET", "/health") == (200, {"status": "ok"})
    assert content(ask(server, "Hi", 6, threshold=1.0)[1]) == reference(ckpt, "Hi", 1.0, 6)[0]


def test_openai_client_sees_errors(server):
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|more than this server's context"):
        client(server).chat.completions.create(model="tiny", messages=chat("x" * 600))
    assert fetch(server, "GET", "/nope")[0] == 404
    conn = http.client.HTTPConnection(*urlsplit(server.url).netloc.split(":"), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Length", str(1 << 30))  # refused before a byte of the body is read
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    assert fetch(server, "POST", "/v1/completions", {"prompt": "hi"})[0] == 404


def test_limits_return_429_and_load_lowers_tau(ckpt):
    # Two rows, one queue place: the fourth request is refused, not queued, and the server carries on.
    server = start(ckpt[0], step_s=0.03, max_rows=2, max_queue=1)
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(ask, server, "Hi", 100)
            assert wait_for(server, running_rows=1)["tau"] == 1.0  # one row of two busy: exact AR
            second = pool.submit(ask, server, "tell me a story", 100)
            assert wait_for(server, running_rows=2)["tau"] == 0.5  # every row busy: tau_min
            third = pool.submit(ask, server, "ok", 4)
            wait_for(server, queue_depth=1)
            status, r = ask(server, "x", 4)
            assert status == 429 and r["error"]["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                client(server).chat.completions.create(model="tiny", messages=chat("x"), max_tokens=4)
            results = [f.result() for f in (first, second, third)]
        assert [status for status, _ in results] == [200] * 3
        # The policy's tau reached the response: the first row decoded at 1.0, then at 0.5 under load.
        assert results[0][1]["mars"]["threshold_min"] == 0.5
        m = wait_for(server, running_rows=0, queue_depth=0)
        assert m["tau"] == 1.0 and m["totals"]["rejected"] == 2 and m["totals"]["finished"] == 3
        assert ask(server, "x", 4)[0] == 200
    finally:
        server.close()


def test_a_disconnect_mid_stream_frees_the_row(ckpt):
    server = start(ckpt[0], step_s=0.02, max_rows=2)
    try:
        host, port = urlsplit(server.url).netloc.split(":")
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": chat("tell me a story"), "max_tokens": 400, "threshold": 1.0, "stream": True}))
        r = conn.getresponse()
        assert r.readline().startswith(b"data: ")  # the stream has started
        wait_for(server, running_rows=1)
        r.close()
        conn.close()
        m = wait_for(server, running_rows=0)  # 400 tokens would take 8 s: the row was freed, not finished
        assert m["totals"]["cancelled"] == 1 and m["totals"]["finished"] == 0
        # The freed slot serves the next request from a clean cache.
        assert content(ask(server, "Hi", 20, threshold=0.7)[1]) == reference(ckpt, "Hi", 0.7, 20)[0]
    finally:
        server.close()


def test_models_health_and_metrics(server):
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    assert fetch(server, "GET", "/health") == (200, {"status": "ok"})
    m = fetch(server, "GET", "/metrics")[1]
    assert {"queue_depth", "running_rows", "tau", "tokens_per_second", "tokens_per_forward"} <= set(m)
    assert m["tau"] == 1.0 and m["running_rows"] == 0 and m["totals"]["tokens"] > 0


def test_bench_serve_runs(ckpt, tmp_path, capsys):
    from tools import bench_serve

    file = tmp_path / "test.jsonl"
    rows = [{"messages": [*chat(q), {"role": "assistant", "content": "The answer is 4."}], "family": "arithmetic",
             "answer": "4"} for q in ("What is 2+2?", "2+2?", "Add 2 and 2.")]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The test set's reference answer is not sent as part of the prompt; the scoring keys stay.
    assert bench_serve.read_rows(str(file))[0] == {**rows[0], "messages": chat("What is 2+2?")}
    bench_serve.main(["--ckpt", str(ckpt[0]), "--prompts", str(file), "--clients", "1", "3", "--requests", "3",
                      "--max-tokens", "8", "--max-rows", "2"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[:2] for line in table[1:]] == [
        [f"| {name}", c] for name in ("tau = 1.0", "verify", "adaptive, tau 1.0 if free", "adaptive, verify if free")
        for c in ("1", "3")]
    assert all(line.endswith("| 0.00 |") for line in table[1:])  # accuracy column: a random model scores 0
