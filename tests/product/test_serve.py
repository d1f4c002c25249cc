# serve.py: the OpenAI-compatible server with continuous batching. A tiny random checkpoint is served
# on a loopback port inside the test and driven by the real `openai` client and by raw HTTP; every
# output must equal generate.decode run on the same prompt alone.
import concurrent.futures
import dataclasses
import http.client
import json
import queue
import random
import re
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest
import torch

from conftest import tiny_checkpoint
from generate import Options, decode
from mars import serve
from mars.http_server import Deadline, Handler, exposure_warning, held_back, overlap, stop_cut
from mars.layout import Stats
from mars.tokenizer import Tokenizer
from model import Transformer

B = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Byte-level tokenizer, spread weights with a sharpened embedding (conftest.tiny_model):
    # confidences spread over (0, 1), so thresholds between 0.5 and 0.9 change the output.
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    model, tok = tiny_checkpoint(path)
    return path, model, tok


def start(path, step_s: float = 0.0, gate: threading.Semaphore | None = None, name: str = "tiny",
          **settings) -> serve.Server:
    # A server on an ephemeral loopback port with its own copy of the model; step_s slows every
    # forward down, so a test can catch rows mid-flight, and with a gate every forward first takes one
    # of its permits, so a test decides how many forwards run, whatever the machine's speed. Verify rows
    # feed the full tree unless a test asks for another --draft-budget, so their forwards equal
    # generate.decode's with the default Options.
    s = serve.Settings(ckpt=str(path), port=0,
                       **{"max_len": 512, "max_tokens": 32, "tau_min": 0.5, "draft_budget": "0", **settings})
    model = Transformer.from_pretrained(path).eval()
    if step_s or gate:
        hidden = model.hidden

        def paced(*args, **kwargs):
            if gate:
                gate.acquire()
            time.sleep(step_s)
            return hidden(*args, **kwargs)

        model.hidden = paced
    return serve.start(serve.Engine(model, Tokenizer.from_pretrained(path), s), name=name)


def forwards_of(server) -> list[tuple[int, int]]:
    # Every forward's (rows, positions) from here on, as the engine's model runs it.
    shapes, hidden = [], server.engine.model.hidden
    server.engine.model.hidden = lambda x, *a, **kw: shapes.append(tuple(x.shape)) or hidden(x, *a, **kw)
    return shapes


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
    out, forwards = decode(model, [prompt], tok.mask_id, tok.stop_ids,
                           Options(tau=tau, B=B, max_new_tokens=max_tokens, cache="none", vocab_size=tok.vocab_size))
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
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
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
    prompt, stats = tok.encode_chat(chat(text), add_generation_prompt=True), Stats()
    _, forwards = decode(model, [prompt], tok.mask_id, tok.stop_ids,
                         Options(B=B, max_new_tokens=max_tokens, verify=True, vocab_size=tok.vocab_size),
                         stats=stats)
    return forwards[0], [stats.offered[0], stats.accepted[0]]


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


def test_the_adaptive_budget_changes_speed_only_and_load_alone_never_makes_a_row_lossy(ckpt):
    # The defaults: --draft-budget auto measures the cost of a forward at launch and sizes each step's
    # budget to its rows; --tau-min 1.0, so load never moves a row to the lossy threshold rule. Six
    # requests for two rows queue up, and every answer is the prompt's greedy text decoded alone, while
    # a climb that tries another rung every other step changes the budget all the time.
    from mars import budget
    defaults = serve.Settings()
    assert (defaults.draft_budget, defaults.tau_min) == ("auto", 1.0)
    server = start(ckpt[0], step_s=0.002, max_rows=2, max_queue=8, draft_budget="auto", tau_min=defaults.tau_min)
    policy = server.engine.policy
    assert set(policy.curves) == {1, 2} and all(policy.modelled(R) >= 1 for R in (1, 2))
    policy.climb = budget.Climb(budget.ladder(policy.G), probe=1, period=1)
    texts = ["Hi", "tell me a story", "count to ten", "What is 2+2?", "ok", "a longer question about the sea?"]
    start_line = threading.Barrier(len(texts))

    def one(text):
        start_line.wait()
        return ask(server, text, 24)[1]

    try:
        with ThreadPoolExecutor(len(texts)) as pool:
            got = list(pool.map(one, texts))
        for text, r in zip(texts, got):
            assert content(r) == reference(ckpt, text, 1.0, 24)[0], text
            # never lossy; a step may run as plain AR where the climb tries that rung
            assert r["mars"]["threshold_min"] == 1.0 and 0 < r["mars"]["verify_steps"] <= r["mars"]["forwards"]
        m = wait_for(server, running_rows=0)
        ran = {b for _, b in policy.climb.ran}
        assert m["draft_budget"] in ran and len(ran) >= 3
        # Every step was timed for the budget's overhead term and counted for the climb.
        until(lambda: policy.timings == server.engine.totals["steps"] > 8, "every step's time")
        assert sum(policy.climb.ran.values()) == policy.timings
        assert policy.overhead >= 0.0
    finally:
        server.close()


def test_a_threshold_and_a_tolerance_are_what_a_request_asks_for(ckpt):
    # A request's threshold is generate.py's threshold rule at that tau; "tolerance" asks for base-checked verify.
    _, model, tok = ckpt
    server = start(ckpt[0], max_rows=2)
    prompt = tok.encode_chat(chat("tell me a story"), add_generation_prompt=True)
    opts = Options(tau=0.5, B=B, max_new_tokens=30, vocab_size=tok.vocab_size)
    want, forwards = decode(model, [prompt], tok.mask_id, tok.stop_ids, opts)
    try:
        status, r = ask(server, "tell me a story", 30, threshold=0.5)
        assert status == 200 and content(r) == tok.decode([t for t in want[0] if t not in tok.stop_ids])
        assert r["mars"]["forwards"] == forwards[0] < 30
        status, r = ask(server, "tell me a story", 30, tolerance=0.5)
        assert status == 200 and r["mars"]["verify_steps"] == r["mars"]["forwards"] > 0
        for fields in ({"tolerance": 0.5, "temperature": 0.7}, {"tolerance": 0.5, "threshold": 0.9},
                       {"tolerance": 0.0}):
            status, body = ask(server, "hi", 4, **fields)
            assert status == 400 and body["error"]["param"] == "tolerance", fields
    finally:
        server.close()


def test_free_slots_are_not_forwarded(ckpt):
    # One request on a 4-row server: every forward carries its row alone, and the text is generate.py's.
    server = start(ckpt[0], max_rows=4)
    shapes = forwards_of(server)
    try:
        status, r = ask(server, "tell me a story", 30, threshold=0.5)
        assert status == 200 and content(r) == reference(ckpt, "tell me a story", 0.5, 30)[0]
        rows = [n for n, _ in shapes]
        assert rows and set(rows) == {1} and len(rows) == r["mars"]["forwards"]
    finally:
        server.close()


def test_a_gap_in_the_slots_is_closed_so_a_step_forwards_its_busy_rows_alone(ckpt):
    # Three short requests take slots 0-2 and a long one slot 3. Once the short ones end, the long row moves
    # to slot 0 with its cache entries, and each later forward carries it alone; its text is unchanged.
    gate = threading.Semaphore(0)
    server = start(ckpt[0], gate=gate, max_rows=4)
    shapes = forwards_of(server)
    engine = server.engine
    try:
        with ThreadPoolExecutor(4) as pool:
            asked = []
            for i, (text, n) in enumerate([("Hi", 2), ("ok", 2), ("yes", 2), ("tell me a story", 30)]):
                asked.append(pool.submit(ask, server, text, n, threshold=1.0))
                until(lambda i=i: engine.totals["requests"] == i + 1, f"request {i + 1} queued")
            for _ in range(200):
                gate.release()
            got = [f.result() for f in asked]
        assert all(status == 200 for status, _ in got)
        assert content(got[3][1]) == reference(ckpt, "tell me a story", 1.0, 30)[0]
        rows = [n for n, _ in shapes]
        assert max(rows) > 1 and rows[-10:] == [1] * 10
    finally:
        for _ in range(200):
            gate.release()
        server.close()


def test_a_joining_prompt_runs_a_forward_of_its_own_and_pads_no_running_row(ckpt):
    # A long prompt joins while a row is decoding: its prompt goes through a forward of its own, so the
    # running row never feeds a prompt's width of padding; both answers are the prompts' greedy text alone.
    gate = threading.Semaphore(0)
    server = start(ckpt[0], gate=gate, max_rows=2)
    shapes = forwards_of(server)
    engine, long = server.engine, "a much longer question about the sea and the ships on it, " * 4
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, server, "Hi", 30, threshold=1.0)
            until(lambda: engine.totals["requests"] == 1, "the first request queued")
            for _ in range(4):
                gate.release()
            until(lambda: engine.totals["steps"] >= 3, "the first row decoding")
            second = pool.submit(ask, server, long, 8, threshold=1.0)
            until(lambda: engine.totals["requests"] == 2, "the second request queued")
            for _ in range(200):
                gate.release()
            got = [first.result(), second.result()]
        assert content(got[0][1]) == reference(ckpt, "Hi", 1.0, 30)[0]
        assert content(got[1][1]) == reference(ckpt, long, 1.0, 8)[0]
        prompt = len(ckpt[2].encode_chat(chat(long), add_generation_prompt=True))
        assert (1, prompt) in shapes  # the joining prompt alone
        assert any(rows == 2 for rows, _ in shapes)  # the two rows did decode together
        assert all(width <= 1 + 3 + 12 for rows, width in shapes[1:] if rows > 1)  # never padded to it
    finally:
        for _ in range(200):
            gate.release()
        server.close()


def test_a_step_the_budget_makes_plain_ar_keeps_every_greedy_answer(ckpt):
    # Where drafts cost more than they return (budget.AR_STEP), the greedy rows that verify by default run as
    # AR, one position a step; a request that asked to verify still does. Every answer is its greedy text.
    from mars import budget
    server = start(ckpt[0], max_rows=4, draft_budget="auto", tau_min=1.0)
    server.engine.policy.budget = lambda R: budget.AR_STEP
    shapes = forwards_of(server)
    try:
        status, r = ask(server, "tell me a story", 20)
        assert status == 200 and content(r) == reference(ckpt, "tell me a story", 1.0, 20)[0]
        assert {w for _, w in shapes[1:]} == {1} and "verify_steps" not in r["mars"]
        status, r = ask(server, "tell me a story", 20, verify=True)
        assert status == 200 and content(r) == reference(ckpt, "tell me a story", 1.0, 20)[0]
        assert r["mars"]["verify_steps"] == r["mars"]["forwards"]
        assert wait_for(server, running_rows=0)["draft_budget"] == budget.AR_STEP
    finally:
        server.close()


def test_only_exact_greedy_rows_teach_the_budget_its_acceptance(ckpt):
    # The budget sizes exact greedy verify rows; a sampled row's drafts are accepted by another rule, and a
    # base-checked row's by a looser one, so neither moves the acceptance the budget plans with.
    server = start(ckpt[0], max_rows=2, draft_budget="auto", tau_min=1.0)
    policy = server.engine.policy
    try:
        before = list(policy.tried)
        for fields in ({"temperature": 1.0, "seed": 1, "verify": True}, {"tolerance": 0.5}):
            assert ask(server, "tell me a story", 16, **fields)[0] == 200
        assert policy.tried == before
        assert ask(server, "tell me a story", 16, verify=True)[0] == 200
        assert policy.tried[0] > before[0]
    finally:
        server.close()


def test_a_row_at_tau_one_that_does_not_verify_feeds_no_masks(ckpt):
    # Such a row takes one token a step by rule: after its prompt, every forward feeds it one position, as
    # generate.decode does (B = 1), not one plus B - 1 masks that could never be accepted.
    server = start(ckpt[0], max_rows=4)
    shapes = forwards_of(server)
    try:
        status, r = ask(server, "tell me a story", 20, threshold=1.0, verify=False)
        assert status == 200 and content(r) == reference(ckpt, "tell me a story", 1.0, 20)[0]
        widths = [w for _, w in shapes]
        assert len(widths) == r["mars"]["forwards"] and widths[0] > 1 and set(widths[1:]) == {1}
    finally:
        server.close()


def test_one_slot_serves_greedy_with_the_budget_auto(ckpt):
    # --block-size 1 has no masks, so no drafts: the adaptive budget has nothing to size, and rows are AR.
    server = start(ckpt[0], max_rows=2, block_size=1, draft_budget="auto", tau_min=1.0)
    try:
        assert server.engine.policy.budget(1) == 0
        status, r = ask(server, "tell me a story", 16)
        assert status == 200 and content(r) == reference(ckpt, "tell me a story", 1.0, 16)[0]
    finally:
        server.close()


def test_a_tiny_temperature_is_greedy_and_fails_no_other_row(ckpt):
    # 1e-300 is 0 in float32: the sampled row draws the greedy token (ties aside), and the row decoding beside
    # it in the same steps is not failed by it.
    server = start(ckpt[0], step_s=0.002, max_rows=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            tiny = pool.submit(ask, server, "tell me a story", 16, temperature=1e-300, seed=3)
            other = pool.submit(ask, server, "count to ten", 16, threshold=1.0)
            (s1, r1), (s2, r2) = tiny.result(), other.result()
        assert s1 == s2 == 200
        assert content(r1) == reference(ckpt, "tell me a story", 1.0, 16)[0]
        assert content(r2) == reference(ckpt, "count to ten", 1.0, 16)[0]
    finally:
        server.close()


def test_a_request_that_breaks_a_step_fails_alone(ckpt):
    # Every forward that feeds the poison prompt raises (as a prompt too long for the memory would): the step
    # fails before it changes anything, each row then runs a step alone, and only the poison row fails. The
    # rows beside it, in the step it broke and after, get their greedy text.
    _, _, tok = ckpt
    fine = ["tell me a story", "count to ten"]
    seen = {t for text in fine for t in tok.encode_chat(chat(text), add_generation_prompt=True)
            + reference(ckpt, text, 1.0, 16)[1]}
    poison = next(t for t in map(ord, "~^`{}|@#$") if t not in seen and tok.encode(chr(t)) == [t])
    server = start(ckpt[0], step_s=0.02, max_rows=3)
    hidden, raised = server.engine.model.hidden, []

    def breaks(x, *a, **kw):
        if (x == poison).any():
            raised.append(sum(r is not None for r in server.engine.rows))  # the rows in slots when it raised
            raise RuntimeError("out of memory (a test's)")
        return hidden(x, *a, **kw)

    server.engine.model.hidden = breaks
    texts = [fine[0], chr(poison) * 3, fine[1]]
    start_line = threading.Barrier(len(texts))

    def one(text):
        start_line.wait()
        return ask(server, text, 16, threshold=1.0)

    try:
        with ThreadPoolExecutor(len(texts)) as pool:
            got = list(pool.map(one, texts))
        assert got[1][0] == 500 and "failed" in got[1][1]["error"]["message"]
        for text, (status, r) in zip(texts[::2], got[::2]):
            assert status == 200 and content(r) == reference(ckpt, text, 1.0, 16)[0], text
        m = wait_for(server, running_rows=0)
        assert m["totals"]["failed"] == 1 and m["totals"]["finished"] == 2
        status, r = ask(server, "count to ten", 16, threshold=1.0)  # the engine serves on
        assert status == 200 and content(r) == reference(ckpt, "count to ten", 1.0, 16)[0]
        # The poison joins while a row runs: that row's forward passed, the joining one raised.
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(ask, server, fine[0], 16, threshold=1.0)
            until(lambda: fetch(server, "GET", "/metrics")[1]["running_rows"] == 1, "the row to run")
            assert ask(server, texts[1], 16, threshold=1.0)[0] == 500
            status, r = running.result()
        assert status == 200 and content(r) == reference(ckpt, fine[0], 1.0, 16)[0]
        # A seeded sampled row whose forward drew before the poison's raised draws again from where it was:
        # its text is its text alone.
        alone = ask(server, fine[0], 48, temperature=1.0, seed=5)
        raised.clear()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(ask, server, fine[0], 48, temperature=1.0, seed=5)
            until(lambda: fetch(server, "GET", "/metrics")[1]["running_rows"] == 1, "the row to run")
            assert ask(server, texts[1], 16, threshold=1.0)[0] == 500
            status, r = running.result()
        assert raised and raised[0] == 2  # the step the poison broke ran the seeded row too
        assert status == 200 and alone[0] == 200 and content(r) == content(alone[1])
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
    # usage counts the tokens through the one that completes the stop string, not those a step accepted after it
    tok = ckpt[2]
    through = next(k for k in range(1, len(out) + 1)
                   if stop in tok.decode([t for t in out[:k] if t not in tok.stop_ids]))
    assert r.usage.completion_tokens == through
    events = sse(server, {"messages": chat("tell me a story"), "max_tokens": 40, "stop": stop, "threshold": 0.5})
    parsed = [json.loads(e) for e in events[:-1]]
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in parsed) == full[:i]
    assert parsed[-1]["choices"][0]["finish_reason"] == "stop"
    # A longer stop string that starts before this one and ends after it: this one is met first, whichever
    # tokens each step accepted.
    j = next(j for j in range(1, len(full) - 2) if "\ufffd" not in full[j - 1:j + 2]
             and full.find(full[j]) == j and full.find(full[j - 1:j + 2]) == j - 1)
    r = client(server).chat.completions.create(model="tiny", messages=chat("tell me a story"), max_tokens=40,
                                               stop=[full[j - 1:j + 2], full[j]], extra_body={"threshold": 0.5})
    assert r.choices[0].message.content == full[:j] and r.choices[0].finish_reason == "stop"


def test_a_replayed_tool_conversation_is_refused_as_such(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "content": None, "function_call": call["function"]},  # OpenAI's older API
                 {"role": "tool", "tool_call_id": "c1", "content": "42"}):
        status, r = fetch(server, "POST", "/v1/chat/completions", {"messages": [*chat("hi"), turn]})
        assert status == 400 and r["error"]["param"] == "messages"
        assert "messages[1] is a tool call or a tool's output, and tool calling is not supported here" in \
            r["error"]["message"]


def test_include_usage_sends_usage_in_a_last_chunk_of_its_own(server, ckpt):
    # stream_options.include_usage as OpenAI answers it: usage null on every chunk with choices, then one chunk
    # with no choices and the usage (and the MARS stats), the counts the unstreamed reply gives.
    c = client(server)
    whole = c.chat.completions.create(model="tiny", messages=chat("tell me a story"), max_tokens=12)
    chunks = list(c.chat.completions.create(model="tiny", messages=chat("tell me a story"), max_tokens=12,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(chunk.choices and chunk.usage is None for chunk in chunks[:-1])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1]) == whole.choices[0].message.content
    for body, said in (({"stream_options": {"include_usage": True}}, "'stream_options' goes with 'stream': true"),
                       ({"stream": True, "stream_options": {"include_usage": "yes"}}, "'include_usage' must be bool")):
        status, r = fetch(server, "POST", "/v1/chat/completions", {"messages": chat("hi"), **body})
        assert status == 400 and said in r["error"]["message"]
    chunks = sse(server, {"messages": chat("hi"), "max_tokens": 3, "stream_options": {"include_usage": None}})
    assert "usage" in json.loads(chunks[-2]) and json.loads(chunks[-2])["choices"]  # null: unset, as elsewhere


def test_top_p_0_samples_the_top_token_alone(server, ckpt):
    # OpenAI's clients send top_p 0 for determinism: with verify, a sampled request then gives greedy AR's text.
    r = client(server).chat.completions.create(model="tiny", messages=chat("tell me a story"), max_tokens=30,
                                               temperature=1.5, top_p=0, seed=3, extra_body={"verify": True})
    assert r.choices[0].message.content == reference(ckpt, "tell me a story", 1.0, 30)[0]


def test_a_reply_ends_at_the_stop_string_met_first_whatever_the_steps_sizes():
    # A longer stop that begins before a shorter one inside it: a step of one token completes the short one
    # first, a step that accepts several tokens completes both at once. The cut is the same: the stop string
    # whose first occurrence ends first, as a reader of the text one character at a time meets it.
    text = "is spelled m-o-v-o-l-i. Backwards: i-l-o"
    assert stop_cut(text, ["Backwa", "ck"]) == text.index("ck") and stop_cut(text, ["zz"]) == -1
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(30))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        reference = next((L - max(len(x) for x in stops if text[:L].endswith(x))
                          for L in range(1, len(text) + 1) if any(text[:L].endswith(x) for x in stops)), -1)
        ends, L = [], 0
        while L < len(text):  # random step sizes: the text as the steps reveal it
            L = min(len(text), L + rng.randint(1, 8))
            ends.append(L)
        seen = next((stop_cut(text[:L], stops) for L in ends if stop_cut(text[:L], stops) >= 0), -1)
        assert seen == reference == stop_cut(text, stops), (text, stops)


def test_the_off_values_clients_send_are_accepted_and_top_p_0_is_the_top_token():
    # The openai client and others send these with their defaults: accepted, as the refusals above are not.
    off = {"presence_penalty": 0.0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": 0, "tools": [],
           "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}}
    body = json.dumps({"messages": chat("hi"), **off}).encode()
    assert serve.request_body(body, "messages")["presence_penalty"] == 0.0
    from generate import distribution

    logits = torch.tensor([[0.5, 2.0, 1.9, -1.0]])
    assert distribution(logits, 1.5, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_streaming_holds_back_what_a_later_token_can_change():
    # Not yet sent: the start of a stop string, an unfinished UTF-8 character (U+FFFD for now), and a
    # stop string's start right before such a character ("Y" then the first bytes of "氰").
    assert held_back("abc", ["xyz"]) == 0 and held_back("abc", ["cd", "bcx"]) == 2
    assert held_back("ab\ufffd\ufffd", []) == 2
    assert held_back("aY\ufffd", ["Y氰"]) == 2 and held_back("aY\ufffd", ["Z"]) == 1


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
    ({"messages": chat("hi"), "top_p": 1.5}, "top_p", None),
    ({"messages": chat("x" * 600)}, "messages", "context_length_exceeded"),
    ({"messages": chat("hi"), "max_tokens": 500}, "messages", "context_length_exceeded"),
    # What escaped the parser before and closed the connection without a reply:
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"7" * 5000 + b"}", None, None),
    (b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", None, None),
    ({"messages": [{"role": "user", "content": json.loads('{"a": ' * 900 + "1" + "}" * 900)}]}, "messages", None),
    # Stop strings: at most 4, each at most 256 characters.
    ({"messages": chat("hi"), "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"messages": chat("hi"), "stop": ["z" * 257]}, "stop", None),
    # Fields we cannot honour are refused, not ignored.
    ({"messages": chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "unsupported_parameter"),
    ({"messages": chat("hi"), "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"messages": chat("hi"), "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"messages": chat("hi"), "logprobs": 0}, "logprobs", "unsupported_parameter"),  # /v1/completions' "0 extra"
    ({"messages": chat("hi"), "top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    ({"messages": chat("hi"), "logit_bias": {"7": 5}}, "logit_bias", "unsupported_parameter"),
    ({"messages": chat("hi"), "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ({"messages": chat("hi"), "seed": "7"}, "seed", None),
    ({"messages": chat("hi"), "max_tokens": "abc", "max_completion_tokens": 5}, "max_tokens", None),
    ({"messages": chat("hi"), "max_tokens": 4, "max_completion_tokens": 5}, "max_tokens", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     None),
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
    assert fetch(server, "POST", "/v1/embeddings", {"input": "hi"})[0] == 404


def test_top_p_samples_the_nucleus_as_generate_does(server, ckpt):
    # The openai client's top_p is generate.py's --top-p: a seeded request's text is generate.decode's for
    # the same seed, temperature, threshold and nucleus, and a smaller nucleus gives other text. A greedy
    # request ignores it: its token is in every nucleus.
    _, model, tok = ckpt
    prompt = tok.encode_chat(chat("tell me a story"), add_generation_prompt=True)

    def generated(top_p: float) -> str:
        opts = Options(tau=0.5, B=B, max_new_tokens=30, temperature=1.5, top_p=top_p, vocab_size=tok.vocab_size)
        out, _ = decode(model, [prompt], tok.mask_id, tok.stop_ids, opts, generator=torch.Generator().manual_seed(7))
        return tok.decode([t for t in out[0] if t not in tok.stop_ids])

    got = {top_p: client(server).chat.completions.create(
        model="tiny", messages=chat("tell me a story"), max_tokens=30, temperature=1.5, top_p=top_p, seed=7,
        extra_body={"threshold": 0.5}).choices[0].message.content for top_p in (0.9, 0.3)}
    assert got == {top_p: generated(top_p) for top_p in got} and got[0.9] != got[0.3]
    status, r = ask(server, "tell me a story", 12, top_p=0.1)
    assert status == 200 and content(r) == reference(ckpt, "tell me a story", 1.0, 12)[0]


def completion(ckpt, text: str, max_tokens: int) -> tuple[str, list[int]]:
    # generate.py greedy on the raw text, no chat template: (text without the stop token, tokens)
    _, model, tok = ckpt
    out, _ = decode(model, [tok.encode(text)], tok.mask_id, tok.stop_ids,
                    Options(tau=1.0, B=B, max_new_tokens=max_tokens, cache="none", vocab_size=tok.vocab_size))
    return tok.decode([t for t in out[0] if t not in tok.stop_ids]), out[0]


def test_completions_continue_the_raw_prompt(server, ckpt):
    # OpenAI's legacy /v1/completions, as lm-evaluation-harness's local-completions sends it (a prompt in a
    # list of one, a seed, stop strings) and as the openai client does, streamed or not: the text is
    # generate.py's on the prompt as it is, with no chat template.
    text, prompt = "The story of a cat:", ckpt[2].encode("The story of a cat:")
    want, out = completion(ckpt, text, 16)
    assert ckpt[2].encode_chat(chat(text), add_generation_prompt=True) != prompt
    status, r = fetch(server, "POST", "/v1/completions", {"model": "tiny", "prompt": [text], "max_tokens": 16,
                                                          "temperature": 0, "stop": ["\n\n\n"], "seed": 1234})
    assert status == 200 and r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    assert r["choices"] == [{"index": 0, "text": want, "finish_reason": "length" if len(out) == 16 else "stop",
                             "logprobs": None}]
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                          "total_tokens": len(prompt) + len(out)}
    c = client(server)
    assert c.completions.create(model="tiny", prompt=text, max_tokens=16).choices[0].text == want
    chunks = list(c.completions.create(model="tiny", prompt=text, max_tokens=16, stream=True))
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage.completion_tokens == len(out)
    cut = want[len(want) // 2:][:3]  # a stop string cuts the text before it, as in chat
    if cut:
        status, r = fetch(server, "POST", "/v1/completions", {"prompt": text, "max_tokens": 16, "stop": cut})
        assert r["choices"][0]["text"] == want[:want.index(cut)] and r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param, code, says", [
    ({"max_tokens": 4}, "prompt", None, "missing required field 'prompt'"),
    ({"prompt": ["a", "b"]}, "prompt", None, "one prompt per request"),
    ({"prompt": [[1, 2, 3]]}, "prompt", None, "tokenized_requests=False"),
    ({"prompt": ""}, "prompt", None, "non-empty string"),
    ({"prompt": "x" * 600}, "prompt", "context_length_exceeded", "the prompt takes 600 tokens"),
    ({"prompt": "hi", "echo": True}, "echo", "unsupported_parameter", "not supported"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter", "not supported"),
    ({"prompt": "hi", "messages": chat("hi"), "top_p": 2}, "top_p", None, "[0, 1]"),
])
def test_bad_completions_get_400_naming_the_field(server, body, param, code, says):
    status, r = fetch(server, "POST", "/v1/completions", body)
    assert status == 400 and (r["error"]["param"], r["error"]["code"]) == (param, code)
    assert says in r["error"]["message"]


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
            {"messages": chat("tell me a story"), "max_tokens": 400, "threshold": 1.0, "stream": True}),
            headers={"Content-Type": "application/json"})
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
    assert client(server).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4")
    # A request for a model not served here is refused as OpenAI refuses it, not answered by this one.
    with pytest.raises(openai.NotFoundError) as e:
        client(server).chat.completions.create(model="gpt-4", messages=chat("hi"), max_tokens=2)
    assert e.value.code == "model_not_found"
    status, r = fetch(server, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and (r["error"]["param"], r["error"]["code"]) == ("model", "model_not_found")
    status, r = fetch(server, "POST", "/v1/chat/completions", {"model": 5, "messages": chat("hi")})
    assert status == 400 and r["error"]["param"] == "model"
    assert fetch(server, "GET", "/health") == (200, {"status": "ok"})
    m = fetch(server, "GET", "/metrics")[1]
    assert {"queue_depth", "running_rows", "tau", "tokens_per_second", "tokens_per_forward"} <= set(m)
    assert m["tau"] == 1.0 and m["running_rows"] == 0 and m["totals"]["tokens"] > 0


def test_a_model_named_with_a_colon_and_a_slash_is_found(ckpt):
    named = start(ckpt[0], name="Qwen/qwen2.5:0.5b")
    try:  # sent as it is or percent-encoded
        for path in ("/v1/models/Qwen/qwen2.5:0.5b", "/v1/models/Qwen%2Fqwen2.5%3A0.5b"):
            assert fetch(named, "GET", path) == (200, fetch(named, "GET", "/v1/models")[1]["data"][0])
    finally:
        named.close()


def test_bench_serve_runs(ckpt, tmp_path, capsys):
    from tools import bench_serve

    file = tmp_path / "test.jsonl"
    rows = [{"messages": [*chat(q), {"role": "assistant", "content": "The answer is 4."}], "family": "arithmetic",
             "answer": "4"} for q in ("What is 2+2?", "2+2?", "Add 2 and 2.")]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The test set's reference answer is not sent as part of the prompt; the scoring keys stay.
    assert bench_serve.read_rows(str(file))[0] == {**rows[0], "messages": chat("What is 2+2?")}
    out = tmp_path / "serving.json"
    bench_serve.main(["--ckpt", str(ckpt[0]), "--prompts", str(file), "--clients", "1", "3", "--requests", "3",
                      "--max-tokens", "8", "--max-rows", "2", "--out", str(out), "--model", "tiny"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[:2] for line in table[1:]] == [
        [f"| {name}", c] for name in ("adaptive", "full tree", "ar") for c in ("1", "3")]
    assert all(line.endswith("| 3/3 | 0.00 |") for line in table[1:])  # greedy: exact; a random model scores 0
    report = json.loads(out.read_text())["tiny"]
    assert set(report["policies"]) == {"adaptive", "full tree", "ar"}
    assert set(report["draft_budget_by_rows"]) == {"1", "2"}
    level = report["policies"]["adaptive"][1]
    assert level["clients"] == 3 and level["greedy_identical"] == level["greedy_total"] == 3
    assert {"requests_per_s", "tokens_per_s"} <= set(level)


# ---- hardening: no request stalls the others, no web page drives the server ----

def request_bytes(server, method: str, path: str, body: bytes = b"", host: str | None = None, **headers) -> bytes:
    # One raw HTTP/1.1 request; headers given as Content_Type="..." (underscores become dashes).
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host or urlsplit(server.url).netloc}", "Connection: close",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def raw(server, data: bytes, wait: float = 5.0) -> tuple[bytes, float]:
    # Sends bytes on a fresh connection; returns everything the server sent until it closed, and when
    # it closed. A server that keeps the connection open fails the test (socket timeout).
    t0 = time.monotonic()
    with socket.create_connection(server.server_address, timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - t0


def parse(response: bytes) -> tuple[int, dict, dict]:
    # Raw response -> (status, lower-case headers, JSON body)
    head, body = response.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_body_on_a_get_is_never_read_as_a_request_and_head_has_no_body(server):
    # A GET whose body holds another request: one reply, then the connection closes.
    inner = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
            b"Content-Length: 2\r\n\r\n{}"
    smuggled = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + inner
    for framing in (b"Content-Length: %d\r\n" % len(smuggled), b"Transfer-Encoding: chunked\r\n"):
        response, _ = raw(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + framing + b"\r\n" + smuggled)
        assert response.count(b"HTTP/1.1 ") == 1, response
        status, headers, body = parse(response)
        assert status == 200 and body == {"status": "ok"} and headers["connection"] == "close"
    # HEAD: GET's status and headers with no body, on every path; on a POST route, 405
    for path, status in ((b"/health", 200), (b"/v1/models", 200), (b"/nowhere", 404),
                         (b"/v1/chat/completions", 405)):
        response, _ = raw(server, b"HEAD " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        head, _, rest = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d" % status) and rest == b"", response
        if status == 200:  # the length GET's body has
            get, _ = raw(server, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert b"Content-Length: %d" % len(get.partition(b"\r\n\r\n")[2]) in head


def test_stop_strings_at_the_cap_work_and_the_held_back_check_is_exact(server, ckpt):
    # Four stop strings of the longest allowed length run; held_back() agrees with its definition
    # (the longest proper prefix of a stop string that ends the text) on random small-alphabet strings.
    full = reference(ckpt, "tell me a story", 1.0, 20)[0]
    stops = ["".join(random.Random(i).choices("ab", k=serve.MAX_STOP_CHARS)) for i in range(serve.MAX_STOPS)]
    status, r = ask(server, "tell me a story", 20, threshold=1.0, stop=stops)
    assert status == 200 and content(r) == full
    naive = lambda text, x: max((k for k in range(1, len(x)) if text.endswith(x[:k])), default=0)  # noqa: E731
    rng = random.Random(0)
    for _ in range(2000):
        text, x = "".join(rng.choices("ab", k=rng.randint(0, 12))), "".join(rng.choices("ab", k=rng.randint(1, 8)))
        assert overlap(text, x) == naive(text, x), (text, x)
    assert held_back("x" + "a" * 300, ["a" * 255 + "b"]) == 255  # the worst case for the naive loop


def test_clients_that_hang_up_free_their_row_or_queue_place(ckpt):
    # Non-streaming clients used to keep their rows until max_tokens; now the HTTP thread sees the
    # hang-up within POLL_S and the row or the queue place is freed.
    server = start(ckpt[0], step_s=0.02, max_rows=1, max_queue=4)
    body = lambda n: request_bytes(server, "POST", "/v1/chat/completions", json.dumps(  # noqa: E731
        {"messages": chat("tell me a story"), "max_tokens": n, "threshold": 1.0}).encode(),
        Content_Type="application/json")
    try:
        running = socket.create_connection(server.server_address, timeout=10)
        running.sendall(body(400))  # 400 tokens take 8 s here
        wait_for(server, running_rows=1)
        queued = socket.create_connection(server.server_address, timeout=10)
        queued.sendall(body(5))
        wait_for(server, queue_depth=1)
        t0 = time.monotonic()
        queued.close()
        wait_for(server, queue_depth=0, running_rows=1)
        running.close()
        m = wait_for(server, running_rows=0)
        assert time.monotonic() - t0 < 3 and m["totals"]["cancelled"] == 2 and m["totals"]["finished"] == 0
        # The freed slot serves the next request from a clean cache.
        assert content(ask(server, "Hi", 20, threshold=0.7)[1]) == reference(ckpt, "Hi", 0.7, 20)[0]
    finally:
        server.close()


def test_slow_or_silent_connections_are_closed(ckpt):
    # Every connection must deliver a whole request within --timeout: a partial one gets 408, a silent
    # or idle keep-alive one is closed quietly. A trickle of bytes does not extend the deadline.
    server = start(ckpt[0], timeout=0.5)
    try:
        post = request_bytes(server, "POST", "/v1/chat/completions", b"", Content_Type="application/json")
        for partial in [post[:40],  # slowloris: headers that never end
                        post.replace(b"Content-Length: 0", b"Content-Length: 100") + b"{}",  # a body that never ends
                        b"GET /health"]:  # a request line that never ends
            response, seconds = raw(server, partial)
            status, headers, body = parse(response)
            assert status == 408 and body["error"]["code"] == "request_timeout" and 0.4 < seconds < 3
        assert raw(server, b"")[0] == b""  # silent: closed without a reply
        with socket.create_connection(server.server_address, timeout=5) as sock:  # trickle: 1 byte / 0.1 s
            t0 = time.monotonic()
            with pytest.raises(OSError):  # the server closes it mid-trickle (broken pipe or reset)
                for byte in post[:60]:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
            assert time.monotonic() - t0 < 3
        # An idle keep-alive connection is closed after a complete exchange, without a stray 408.
        conn = http.client.HTTPConnection(*urlsplit(server.url).netloc.split(":"), timeout=5)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status": "ok"}'
        time.sleep(1.0)
        assert conn.sock.recv(100) == b""
        conn.close()
        # A request line without an HTTP version gets a real HTTP/1.1 400, not a bare HTTP/0.9 body.
        response, _ = raw(server, b"GET /health\r\n")
        assert response.startswith(b"HTTP/1.1 400 ") and "HTTP version" in parse(response)[2]["error"]["message"]
    finally:
        server.close()


def test_connections_are_capped(ckpt):
    server = start(ckpt[0], timeout=5.0, max_connections=2)
    server.limits = dataclasses.replace(server.limits, grace=600.0)  # the idle ones keep their places
    try:
        idle = [socket.create_connection(server.server_address, timeout=5) for _ in range(2)]
        for _ in range(500):  # until the server has accepted both
            if len(server.connections) == 2:
                break
            time.sleep(0.01)
        status, headers, body = parse(raw(server, b"")[0])  # refused at once, without a thread
        assert status == 503 and headers["retry-after"] == "1" and "--max-connections 2" in body["error"]["message"]
        for sock in idle:
            sock.close()
        for _ in range(500):
            if not server.connections:
                break
            time.sleep(0.01)
        assert parse(raw(server, request_bytes(server, "GET", "/health"))[0])[0] == 200
    finally:
        server.close()


def test_keep_alive_and_pipelining(server):
    # Two requests in one write on one connection: two answers, in order, and the connection stays open.
    two = (request_bytes(server, "GET", "/health").replace(b"Connection: close", b"Connection: keep-alive")
           + request_bytes(server, "GET", "/v1/models"))
    response, _ = raw(server, two)
    assert response.count(b"HTTP/1.1 200 OK") == 2 and response.index(b'"status"') < response.index(b'"tiny"')
    conn = http.client.HTTPConnection(*urlsplit(server.url).netloc.split(":"), timeout=10)
    for _ in range(3):
        conn.request("POST", "/v1/chat/completions", json.dumps({"messages": chat("Hi"), "max_tokens": 3}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 3
        assert conn.sock is not None  # the same connection carries the next request
    conn.close()


def test_a_web_page_cannot_drive_the_server(server):
    # A cross-origin page can POST text/plain or a form without a CORS preflight: 415. With JSON it
    # needs a preflight, which gets no CORS headers. DNS rebinding sends the attacker's Host: 403.
    body = json.dumps({"messages": chat("Hi"), "max_tokens": 3}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content_Type": kind} if kind else {}
        status, _, r = parse(raw(server, request_bytes(server, "POST", "/v1/chat/completions", body, **headers))[0])
        assert status == 415 and r["error"]["code"] == "unsupported_media_type"
    ok = request_bytes(server, "POST", "/v1/chat/completions", body, Content_Type="application/json; charset=utf-8",
                       Origin="http://evil.example")
    status, headers, _ = parse(raw(server, ok)[0])
    assert status == 200 and not any(h.startswith("access-control-") for h in headers)
    preflight = request_bytes(server, "OPTIONS", "/v1/chat/completions", Origin="http://evil.example",
                              Access_Control_Request_Method="POST", Access_Control_Request_Headers="content-type")
    status, headers, _ = parse(raw(server, preflight)[0])
    assert status == 405 and not any(h.startswith("access-control-") for h in headers)
    port = server.server_address[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        status, _, r = parse(raw(server, request_bytes(server, "GET", "/v1/models", host=host))[0])
        assert status == 403 and r["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"[::1]:{port}", "LOCALHOST.", f"127.0.0.1:{port}"):
        assert parse(raw(server, request_bytes(server, "GET", "/v1/models", host=host))[0])[0] == 200
    two_hosts = request_bytes(server, "GET", "/health").replace(b"Connection:", b"Host: evil.example\r\nConnection:")
    assert parse(raw(server, two_hosts)[0])[0] == 403


def test_allowed_hosts_and_api_key(ckpt, monkeypatch, capsys):
    server = start(ckpt[0], api_key="sekret-key-1", allowed_hosts=["mars.internal"])
    try:
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret-key-1", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=chat("Hi"), max_tokens=3).usage.completion_tokens
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bad.chat.completions.create(model="tiny", messages=chat("Hi"), max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        status, headers, _ = parse(raw(server, request_bytes(server, "GET", "/metrics"))[0])
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert parse(raw(server, request_bytes(server, "GET", "/health"))[0])[0] == 200  # for load balancers
        assert parse(raw(server, request_bytes(server, "GET", "/health", host="mars.internal:80"))[0])[0] == 200
    finally:
        server.close()
    # launch() (what main runs) takes the key from MARS_API_KEY and never prints it.
    monkeypatch.setenv("MARS_API_KEY", "sekret-env-key")
    server = serve.launch(serve.Settings(ckpt=str(ckpt[0]), port=0, quiet=True))
    try:
        assert "sekret-env-key" not in capsys.readouterr().err
        assert parse(raw(server, request_bytes(server, "GET", "/v1/models"))[0])[0] == 401
        authorized = request_bytes(server, "GET", "/v1/models", Authorization="Bearer sekret-env-key")
        assert parse(raw(server, authorized)[0])[0] == 200
    finally:
        server.close()


def test_a_bad_port_or_queue_flag_is_named_alone():
    for settings, flag, other in [(serve.Settings(port=99999), "--port 99999", "--max-queue"),
                                  (serve.Settings(max_queue=-1), "--max-queue -1", "--port")]:
        with pytest.raises(ValueError) as e:
            serve.check_settings(settings)
        assert str(e.value).startswith(flag) and other not in str(e.value)


def test_launch_says_when_it_measures_the_draft_budget(ckpt, capsys, monkeypatch):
    # The measuring takes tens of seconds on a CPU: a line says so before it starts, and one when it is done.
    # The estimate prices exactly the forwards measured_policy times.
    measure, measured, timed = serve.budget.measure, serve.measured_policy, []

    def fake_measure(model, R, widths, context=256, reps=3, **_):  # a forward costs 1 ms + 10 us a position
        timed.append(1e-3 * (1 + R * context / 100) + (reps + 1) * sum(1e-3 * (1 + R * n / 100) for n in widths))
        return [1e-3 * (1 + R * n / 100) for n in widths]

    def measuring(model, s):
        assert capsys.readouterr().err.endswith(" s)...\n")  # printed before any forward is timed
        policy = measured(model, s)
        with monkeypatch.context() as patch:
            patch.setattr(serve.budget, "measure", fake_measure)
            estimate = serve.measuring_seconds(model, s)
            timed.clear()
            measured(model, s)
        assert estimate == pytest.approx(sum(timed), rel=1e-6)
        return policy

    monkeypatch.setattr(serve, "measured_policy", measuring)
    server = serve.launch(serve.Settings(ckpt=str(ckpt[0]), port=0, quiet=True, max_rows=3))
    server.close()
    assert measure is serve.budget.measure
    assert re.search(r"^measured in \d+ s; starting draft budget per row", capsys.readouterr().err, re.M)


def test_binding_beyond_loopback_without_a_key_warns():
    assert exposure_warning("0.0.0.0", "") and exposure_warning("192.168.1.5", "")
    assert exposure_warning("", "") and exposure_warning("myhost.example", "")
    assert not any(exposure_warning(h, "") for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert exposure_warning("0.0.0.0", "a-key") is None
    assert serve.Settings().host == "127.0.0.1"  # loopback by default


def test_openai_fit(server, ckpt):
    # Text content parts (as current clients send them), refused fields, JSON for every method.
    c = client(server)
    parts = [{"type": "text", "text": "tell me"}, {"type": "text", "text": "a story"}]
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=12,
                                  extra_body={"threshold": 1.0})
    assert r.choices[0].message.content == reference(ckpt, "tell me\na story", 1.0, 12)[0]
    # the developer role, which newer clients send in place of system, is the system role
    same = [c.chat.completions.create(model="tiny", messages=[{"role": role, "content": "be brief"}, *chat("Hi")],
                                      max_tokens=8, extra_body={"threshold": 1.0}).choices[0].message.content
            for role in ("system", "developer")]
    assert same[0] == same[1]
    tok = ckpt[2]
    assert serve.chat_prompt([{"role": "developer", "content": "be brief"}, *chat("Hi")], tok) == \
        serve.chat_prompt([{"role": "system", "content": "be brief"}, *chat("Hi")], tok)
    refused = [dict(response_format={"type": "json_object"}), dict(logprobs=True),
               dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])]
    for fields in refused:
        with pytest.raises(openai.BadRequestError, match=f"'{next(iter(fields))}' is not supported") as e:
            c.chat.completions.create(model="tiny", messages=chat("Hi"), max_tokens=3, **fields)
        assert e.value.body["param"] == next(iter(fields))
    for method, path, status in [("PUT", "/v1/chat/completions", 405), ("DELETE", "/health", 405),
                                 ("GET", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
                                 ("FOO", "/", 501), ("PATCH", "/nope", 404)]:
        got, headers, body = parse(raw(server, request_bytes(server, method, path))[0])
        assert got == status and headers["content-type"] == "application/json" and body["error"]["message"]
        assert status != 405 or headers["allow"] == {"GET": "GET, HEAD", "POST": "POST"}[serve.ROUTES[path]]
    # Two Content-Length headers (request smuggling) and a chunked body are refused, not guessed at.
    two = request_bytes(server, "POST", "/v1/chat/completions", b"{}", Content_Type="application/json")
    two = two.replace(b"Content-Length: 2", b"Content-Length: 2\r\nContent-Length: 20")
    assert parse(raw(server, two)[0])[0] == 400
    chunked = request_bytes(server, "POST", "/v1/chat/completions", Content_Type="application/json",
                            Transfer_Encoding="chunked").replace(b"Content-Length: 0\r\n", b"")
    assert parse(raw(server, chunked + b"2\r\n{}\r\n0\r\n\r\n")[0])[0] == 411
    # A too-long prompt without max_tokens is described as such, not as "max_tokens is 1".
    status, r = fetch(server, "POST", "/v1/chat/completions", {"messages": chat("x" * 600)})
    assert status == 400 and "max_tokens" not in r["error"]["message"] and "600" not in r["error"]["message"]


def test_seed_gives_the_same_sampled_text_alone_and_under_load(ckpt):
    server = start(ckpt[0], step_s=0.002, max_rows=4)
    try:
        sampled = lambda seed, text="tell me a story": content(  # noqa: E731
            ask(server, text, 30, temperature=1.5, threshold=0.5, seed=seed)[1])
        alone = sampled(7)
        assert sampled(7) == alone and sampled(8) != alone
        with ThreadPoolExecutor(4) as pool:  # other sampled rows in the same forwards
            busy = list(pool.map(lambda i: sampled(7) if i == 0 else sampled(None, "x" * i), range(4)))
        assert busy[0] == alone
        with ThreadPoolExecutor(2) as pool:  # without a seed, two requests draw different text
            assert len(set(pool.map(lambda _: sampled(None), range(2)))) == 2
    finally:
        server.close()


def test_a_seeded_request_keeps_its_tau_under_load(ckpt):
    # No threshold: alone the policy runs tau_max; with 6 of 8 rows busy it lowers tau for greedy rows,
    # but a seeded sampled request keeps tau_max, so its text is the same every time.
    server = start(ckpt[0], step_s=0.003, max_rows=8, max_queue=8, tau_max=0.95, tau_min=0.5)
    try:
        seeded = lambda: ask(server, "tell me a story", 30, temperature=1.2, seed=11)[1]  # noqa: E731
        alone = seeded()
        assert alone["mars"]["threshold"] == 0.95
        for _ in range(3):
            with ThreadPoolExecutor(7) as pool:
                busy = list(pool.map(lambda i: seeded() if i == 0 else ask(server, "x" * i, 60)[1], range(7)))
            assert content(busy[0]) == content(alone) and busy[0]["mars"]["threshold_min"] == 0.95
            assert min(r["mars"]["threshold_min"] for r in busy[1:]) < 0.95  # the load did lower the greedy rows' tau
    finally:
        server.close()


def test_a_burst_of_64_clients_gets_its_429s_at_once(ckpt):
    # Two rows, no queue: 62 of 64 simultaneous clients are refused, and every refusal arrives before
    # either admitted request (200 forwards of 20 ms) is done: a refusal never waits for decoding.
    server = start(ckpt[0], step_s=0.02, max_rows=2, max_queue=0)
    start_line = threading.Barrier(64)

    def one(_):
        start_line.wait()
        status, _ = ask(server, "tell me a story", 200, threshold=1.0)
        return status, time.monotonic()

    try:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(64)))
        done = sorted(t for status, t in results if status == 200)
        refused = [t for status, t in results if status == 429]
        assert len(done) == 2 and len(refused) == 62 and max(refused) < done[0]
    finally:
        server.close()


def test_load_and_abuse_leave_a_well_behaved_client_alone(ckpt):
    # Bounded: about 10 s. A well-behaved client sends the same greedy request over and over, first
    # alone, then while other clients stream and hang up, send and hang up without reading, hold a
    # slowloris connection, ask with four maximal stop strings, and make ordinary requests. Its median
    # latency must stay within 3x of its unloaded median, and every row must be free at the end.
    # step_s makes a forward cost 20 ms, as a GPU forward would, so the test times the scheduling.
    # Before the fixes, each abandoned request held its row for 200 tokens (4 s) and the 12 rows filled.
    step_s = 0.02
    server = start(ckpt[0], step_s=step_s, max_rows=12, max_queue=16, timeout=1.0)
    host, port = server.server_address
    message = json.dumps({"messages": chat("tell me a story"), "max_tokens": 200, "threshold": 1.0})

    def good() -> float:
        t0 = time.monotonic()
        status, r = ask(server, "What is 2+2?", 16, threshold=1.0)
        assert status == 200 and r["usage"]["completion_tokens"] == 16
        return time.monotonic() - t0

    stop, errors = threading.Event(), []

    def loop(abuse):  # one client doing the same thing again and again, 0.1 s apart
        def run():
            while not stop.wait(0.1):
                try:
                    abuse()
                except Exception as e:  # an abuser's own socket errors are expected; anything else is not
                    if not isinstance(e, OSError):
                        errors.append(e)
        return threading.Thread(target=run, daemon=True)

    def stream_and_hang_up():
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.request("POST", "/v1/chat/completions", json.dumps({**json.loads(message), "stream": True}),
                     {"Content-Type": "application/json"})
        conn.getresponse().readline()
        conn.close()

    def send_and_hang_up():
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(request_bytes(server, "POST", "/v1/chat/completions", message.encode(),
                                       Content_Type="application/json"))
            time.sleep(0.05)

    def slowloris():
        with socket.create_connection((host, port), timeout=5) as sock:
            for byte in request_bytes(server, "POST", "/v1/chat/completions", message.encode()):
                sock.sendall(bytes([byte]))
                time.sleep(0.2)

    def long_stops():
        stops = ["".join(random.Random(i).choices("ab", k=serve.MAX_STOP_CHARS)) for i in range(serve.MAX_STOPS)]
        assert ask(server, "tell me a story", 100, threshold=1.0, stop=stops)[0] == 200

    def ordinary():
        assert ask(server, "count to ten", 40, threshold=1.0)[0] == 200

    try:
        good()  # warm-up
        unloaded = [good() for _ in range(3)]
        if statistics.median(unloaded) > 4 * 17 * step_s:  # 17 forwards of step_s: the CPU sets the pace
            pytest.skip(f"this machine is too loaded to time the server: an unloaded request took "
                        f"{statistics.median(unloaded):.2f} s against {17 * step_s:.2f} s of forwards")
        unloaded = statistics.median(unloaded + [good() for _ in range(4)])
        threads_before = threading.active_count()
        abusers = [loop(f) for f in (stream_and_hang_up, send_and_hang_up, send_and_hang_up, slowloris, long_stops,
                                     ordinary, ordinary)]
        for t in abusers:
            t.start()
        time.sleep(0.5)
        loaded = statistics.median(good() for _ in range(7))
        stop.set()
        for t in abusers:  # each finishes what it is doing: at most a 100-token request
            t.join(timeout=30)
        assert not errors and not any(t.is_alive() for t in abusers)
        print(f"well-behaved client, median latency: unloaded {unloaded:.3f} s, under abuse {loaded:.3f} s "
              f"({loaded / unloaded:.2f}x)")
        assert loaded <= 3 * unloaded, (loaded, unloaded)
        m = wait_for(server, running_rows=0, queue_depth=0)
        assert m["totals"]["cancelled"] > 10 and m["totals"]["failed"] == 0 and m["totals"]["rejected"] == 0
        for _ in range(300):  # every connection thread ends: nothing leaks
            if threading.active_count() <= threads_before and not server.connections:
                break
            time.sleep(0.01)
        assert threading.active_count() <= threads_before and not server.connections
    finally:
        stop.set()
        server.close()


# ---- refusals that a client can read, and a server that drains ----

def until(condition, what: str, seconds: float = 60.0) -> None:
    # Waits for a condition that some other thread brings about; the bound is only there to fail a hang.
    due = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < due, f"waited {seconds:g} s for {what}"
        time.sleep(0.01)


def test_refusals_at_the_cap_and_for_a_large_body_are_read_by_the_client(ckpt):
    # A socket closed with unread bytes is reset: the client would see a broken pipe, not the reply.
    server = start(ckpt[0], timeout=30.0, max_connections=1)
    server.limits = dataclasses.replace(server.limits, grace=600.0)  # the idle one keeps its place
    try:
        host, port = urlsplit(server.url).netloc.split(":")
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=b"x" * (10 << 20),  # more than the socket buffers
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "body_too_large"
        conn.close()
        until(lambda: not server.connections, "the refused connection to close")
        idle = socket.create_connection(server.server_address, timeout=30)
        until(lambda: server.connections, "the idle connection to be accepted")
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": chat("Hi")}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 503 and "--max-connections 1" in json.loads(r.read())["error"]["message"]
        idle.close()
    finally:
        server.close()


def test_at_the_cap_a_new_client_takes_the_place_of_the_slowest_connection(ckpt):
    # Slowloris connections hold every place, each sending half a request head and nothing more, and
    # the attacker opens another each time one closes. An ordinary client is still served at once: it
    # takes the place of the connection that has waited longest for its request (over the grace), which
    # is closed unanswered. The attacker's newest connection is inside the grace, and keeps its place.
    server = start(ckpt[0], timeout=30.0, max_connections=4)
    half = request_bytes(server, "POST", "/v1/chat/completions", b"")[:30]
    slow = []

    def connect_slow():
        slow.append(socket.create_connection(server.server_address, timeout=30))
        slow[-1].sendall(half)
        n = len(slow)
        until(lambda: sum(r.received > 0 for r in list(server.connections.values())) == min(n, 4),
              "the slow connection's bytes to arrive")

    def closed(sock) -> bool:
        sock.settimeout(5.0)
        try:
            return sock.recv(65536) == b""
        except TimeoutError:
            return False

    try:
        for _ in range(4):
            connect_slow()
        for _ in range(3):
            time.sleep(server.limits.grace)  # the older slow connections have now waited over the grace
            t0 = time.monotonic()
            status = parse(raw(server, request_bytes(server, "GET", "/health"), wait=30)[0])[0]
            assert status == 200 and time.monotonic() - t0 < 15
            connect_slow()  # the attacker takes the freed place back
        assert [closed(sock) for sock in slow[:3]] == [True] * 3  # the three oldest, in order, unanswered
        assert len(server.connections) == 4 and all(not r.evicted for r in server.connections.values())
    finally:
        for sock in slow:
            sock.close()
        server.close()


def test_an_evicted_connection_frees_its_place_before_its_thread_has_ended(ckpt, monkeypatch):
    # The evicted connection's thread may take a while to read the end of its connection. Its place is
    # free at once all the same: the next client must not evict a second slow connection.
    server = start(ckpt[0], timeout=30.0, max_connections=2)
    half = request_bytes(server, "POST", "/v1/chat/completions", b"")[:30]
    slow = [socket.create_connection(server.server_address, timeout=30) for _ in range(2)]
    try:
        for sock in slow:
            sock.sendall(half)
        until(lambda: sum(r.received > 0 for r in list(server.connections.values())) == 2, "the slow bytes")
        readers = list(server.connections.values())
        time.sleep(server.limits.grace)
        # Without the shutdown that wakes it, the evicted connection's thread stays in its read.
        with monkeypatch.context() as patch:
            patch.setattr(socket.socket, "shutdown", lambda sock, how: None)
            assert server.evict()
        assert len(server.connections) == 1 and sum(r.evicted for r in readers) == 1
        assert parse(raw(server, request_bytes(server, "GET", "/health"), wait=30)[0])[0] == 200
        assert sum(r.evicted for r in readers) == 1  # the health request took the free place
        evicted = next(r for r in readers if r.evicted)
        evicted.sock.shutdown(socket.SHUT_RDWR)  # now its thread ends
    finally:
        for sock in slow:
            sock.close()
        server.close()


def test_only_a_client_that_holds_its_request_head_up_can_lose_its_place():
    # A connection that has waited over the grace loses its place only where its thread waits in recv
    # and no whole request head has come: read, waiting in the socket, or the two together.
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for read, unread, waiting, evicted in [(b"", b"", True, True), (b"", head[:30], True, True),
                                           (head[:30], b"", True, True), (b"", head, True, False),
                                           (head[:-3], head[-3:], True, False), (head, b"", True, False),
                                           (b"", b"", False, False), (b"", head[:30], False, False)]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            ours.settimeout(30.0)
            reader = Deadline(ours, timeout=30.0)
            reader.expect(time.monotonic() + 30.0 - 5.0)  # it has waited 5 s for this request
            theirs.sendall(read)
            if read:
                assert reader.readinto(bytearray(len(read))) == len(read)
            theirs.sendall(unread)
            reader.waiting = waiting  # its thread in recv, or busy elsewhere (not yet given the CPU)
            assert reader.evict(time.monotonic() - 1.0) == evicted, (read, unread, waiting)
            assert not evicted or theirs.recv(100) == b""  # closed unanswered


def test_at_the_cap_requests_already_sent_are_answered_however_late_the_server_reads_them(ckpt, monkeypatch):
    # A burst on a loaded machine: every place holds a connection whose request sits whole in its socket
    # while its thread waits for the CPU to read it, longer than the grace. Its client holds nothing up:
    # newcomers get 503 rather than its place, and it gets its 200 once read. Every client reads an HTTP
    # status, none a connection closed without a reply.
    server = start(ckpt[0], timeout=30.0, max_connections=4)
    server.limits = dataclasses.replace(server.limits, grace=0.2)
    gate, recv_into = threading.Event(), socket.socket.recv_into

    def slow_to_read(sock, *args):  # the server's connection threads read once the gate opens
        if sock in server.connections:
            gate.wait()
        return recv_into(sock, *args)

    def status(sock) -> int | None:
        response = b"".join(iter(lambda: sock.recv(65536), b""))
        sock.close()
        return parse(response)[0] if response else None

    monkeypatch.setattr(socket.socket, "recv_into", slow_to_read)
    first = []
    try:
        for _ in range(4):
            first.append(socket.create_connection(server.server_address, timeout=30))
            first[-1].sendall(request_bytes(server, "GET", "/health"))
        until(lambda: len(server.connections) == 4 and all(r.waiting for r in list(server.connections.values())),
              "every place to hold a thread waiting to read its request")
        time.sleep(2 * server.limits.grace)
        with ThreadPoolExecutor(4) as pool:
            late = [pool.submit(lambda: parse(raw(server, request_bytes(server, "GET", "/health"), wait=30)[0])[0])
                    for _ in range(4)]
            done, _ = concurrent.futures.wait(late, timeout=15)  # one that took a place would wait for the gate
            gate.set()
            statuses = [status(sock) for sock in first] + [f.result() for f in late]
        assert statuses == [200] * 4 + [503] * 4 and len(done) == 4
    finally:
        gate.set()
        for sock in first:
            sock.close()
        server.close()


def test_a_flood_of_new_slow_connections_leaves_other_clients_a_fast_503_then_service(ckpt):
    # Slowloris connections fill the cap and more of them queue for it, each sending half a request
    # head and nothing more, all inside the grace (here longer than the test), so none can be replaced.
    # An ordinary client is answered 503 at once (a reply it reads, long before the 30 s the slow ones
    # may hold their places), and served as soon as they are gone.
    server = start(ckpt[0], timeout=30.0, max_connections=4)
    server.limits = dataclasses.replace(server.limits, grace=600.0)
    half = request_bytes(server, "POST", "/v1/chat/completions", b"")[:30]
    slow = []
    try:
        for _ in range(4):
            slow.append(socket.create_connection(server.server_address, timeout=30))
            slow[-1].sendall(half)
        until(lambda: len(server.connections) == 4, "the cap to fill")
        for _ in range(8):  # over the cap: each holds a refusing thread until it has paused for LINGER_S
            slow.append(socket.create_connection(server.server_address, timeout=30))
            slow[-1].sendall(half)
        t0 = time.monotonic()
        status, headers, body = parse(raw(server, request_bytes(server, "GET", "/health"), wait=30)[0])
        assert status == 503 and headers["retry-after"] == "1" and time.monotonic() - t0 < 15
        for sock in slow[4:]:  # the ones over the cap got their 503 too, once their wait was up
            assert parse(b"".join(iter(lambda s=sock: s.recv(65536), b"")))[0] == 503
        for sock in slow:
            sock.close()
        until(lambda: not server.connections, "the slow connections to close")
        assert parse(raw(server, request_bytes(server, "GET", "/health"), wait=30)[0])[0] == 200
    finally:
        for sock in slow:
            sock.close()
        server.close()


def test_100_continue_only_for_a_request_that_will_be_read_and_absolute_targets_are_checked(server):
    body = json.dumps({"messages": chat("Hi"), "max_tokens": 3}).encode()
    big = request_bytes(server, "POST", "/v1/chat/completions", Content_Type="application/json",
                        Expect="100-continue").replace(b"Content-Length: 0", b"Content-Length: %d" % (10 << 20))
    response, _ = raw(server, big, wait=30)
    assert b"100 Continue" not in response and parse(response)[0] == 413
    head = request_bytes(server, "POST", "/v1/chat/completions", Content_Type="application/json",
                         Expect="100-continue").replace(b"Content-Length: 0", b"Content-Length: %d" % len(body))
    with socket.create_connection(server.server_address, timeout=30) as sock:
        sock.sendall(head)
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        response = b"".join(iter(lambda: sock.recv(65536), b""))
    assert parse(response)[0] == 200
    netloc = urlsplit(server.url).netloc
    for target in ("http://evil.example/v1/models", "http://x@evil.example/health"):  # (//evil.example/...: a path)
        status, _, r = parse(raw(server, request_bytes(server, "GET", target))[0])
        assert status == 403 and r["error"]["code"] == "host_not_allowed" and "evil.example" in r["error"]["message"]
    assert parse(raw(server, request_bytes(server, "GET", f"http://{netloc}/health"))[0])[0] == 200


def stream_lines(conn: http.client.HTTPConnection, body: dict) -> http.client.HTTPResponse:
    # A streaming request whose first event (the role chunk, sent before any forward) has arrived.
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    return r


def payloads(r: http.client.HTTPResponse) -> list[str]:
    return [line[len("data: "):] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]


def test_drain_lets_running_streams_finish_and_takes_no_new_work(ckpt):
    # The forwards are gated: none runs until the drain has begun, so the stream is running when it
    # starts, however fast the machine. A keep-alive connection gets 503 for a new request and a new
    # connection is refused; the stream then finishes, and the drain returns without waiting its 60 s.
    gate = threading.Semaphore(0)
    server = start(ckpt[0], gate=gate, max_rows=2)
    host, port = urlsplit(server.url).netloc.split(":")
    try:
        other = http.client.HTTPConnection(host, port, timeout=60)
        other.request("GET", "/health")
        assert other.getresponse().read() == b'{"status": "ok"}'
        short = stream_lines(http.client.HTTPConnection(host, port, timeout=60),
                             {"messages": chat("Hi"), "max_tokens": 5, "threshold": 1.0})
        drain = threading.Thread(target=server.drain, args=(60.0,))
        drain.start()
        until(lambda: server.engine.draining, "the drain to start")
        other.request("POST", "/v1/chat/completions", body=json.dumps({"messages": chat("Hi")}),
                      headers={"Content-Type": "application/json"})
        r = other.getresponse()
        assert r.status == 503 and json.loads(r.read())["error"]["code"] == "shutting_down"
        with pytest.raises(OSError):
            socket.create_connection(server.server_address, timeout=30)
        gate.release(1000)
        events = payloads(short)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        drain.join(timeout=50)
        assert not drain.is_alive()  # it ended when the last row did, not at its deadline
    finally:
        gate.release(1000)
        server.close()


def test_drain_cuts_a_stream_at_the_deadline_with_an_error_and_done(ckpt):
    # Three forwards run, then the gate stays shut: 400 tokens cannot finish within the drain's 0.1 s.
    # Once the drain has stopped waiting (the engine is told to stop), the gate opens.
    gate = threading.Semaphore(3)
    server = start(ckpt[0], gate=gate, max_rows=2)
    host, port = urlsplit(server.url).netloc.split(":")
    try:
        long = stream_lines(http.client.HTTPConnection(host, port, timeout=60),
                            {"messages": chat("tell me a story"), "max_tokens": 400, "threshold": 1.0})
        drain = threading.Thread(target=server.drain, args=(0.1,))
        drain.start()
        until(lambda: server.engine.stopped, "the drain's deadline")
        gate.release(1000)
        events = payloads(long)
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])  # the tokens before the cut
        drain.join(timeout=60)
        assert not drain.is_alive()
    finally:
        gate.release(1000)
        server.close()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_server_and_it_exits_zero(ckpt, sig):
    import os
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "serve.py", "--ckpt", str(ckpt[0]), "--port", "0", "--quiet",
                          "--device", "cpu", "--drain-seconds", "0"], stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(serve.__file__)))
    watchdog = threading.Timer(300, p.kill)  # a hang fails the test instead of stalling the suite
    watchdog.start()
    try:
        while "serving" not in (line := p.stderr.readline()):
            assert line, "the server did not start"
        host, port = urlsplit(line.split(" on ")[1].split()[0]).netloc.split(":")
        r = stream_lines(http.client.HTTPConnection(host, port, timeout=60),
                         {"messages": chat("tell me a story"), "max_tokens": 400, "threshold": 1.0})
        p.send_signal(getattr(signal, sig))
        events = payloads(r)
        # The stream ends properly either way: finished before the signal, or cut with an error event.
        last = json.loads(events[-2])
        assert events[-1] == "[DONE]" and ("error" in last or last["choices"][0]["finish_reason"] in ("stop", "length"))
        assert p.wait(timeout=120) == 0 and "stopped" in p.stderr.read()
    finally:
        watchdog.cancel()
        p.kill()
        p.wait()


def test_a_client_that_hangs_up_is_seen_while_its_rows_text_keeps_coming():
    # A non-streamed answer waits on its row's events, which come at nearly every step: the socket is still
    # looked at every POLL_S, so a hang-up frees the row then, not at max_tokens.
    handler = Handler.__new__(Handler)  # no connection: hung_up is the stand-in's
    handler.hung_up, events, stop = lambda: time.monotonic() > t_hang, queue.Queue(), threading.Event()

    def steps():  # a step every 5 ms, each with its text
        while not stop.is_set():
            events.put("text")
            time.sleep(0.005)

    t_hang = time.monotonic() + 0.2
    threading.Thread(target=steps, daemon=True).start()
    seen = None
    try:
        for _ in range(400):  # 2 s of steps at the most
            if handler.wait(events) is None:
                seen = time.monotonic()
                break
    finally:
        stop.set()
    assert seen is not None and handler.close_connection and seen - t_hang < 0.5
