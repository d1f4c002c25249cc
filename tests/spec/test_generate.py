# generate.py: MARS decoding (docs/method.md §6), its KV caches (§7) and self-verification (§9,
# mars/verify.py). Every comparison is exact token equality in float32 on tiny random models.
import ast
import contextlib
import itertools
import json
import re
from dataclasses import replace

import pytest
import torch

import generate
import mars.verify
from conftest import tiny_checkpoint, tiny_model
from generate import Group, Options, decode, decode_naive, decode_step, main, sample
from mars.layout import Drafts, Stats, budget_layout
from mars.verify import speculative
from model import Transformer

MASK = 63  # the tiny models' mask id: their last vocabulary row


def prompts(lengths=(3, 17, 40, 1), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK - 1, (n,), generator=g).tolist() for n in lengths]


def per_row(model, ps, stops, **kw) -> tuple[list[list[int]], list[int]]:
    # The oracle, one prompt at a time.
    runs = [decode_naive(model, p, MASK, stops, Options(**kw)) for p in ps]
    return [o for o, _ in runs], [f for _, f in runs]


def sliding_window(model, prompt, tau, B, max_new) -> tuple[list[int], int]:
    # docs/method.md §6 written out directly on model.forward, independent of generate.py (no stop ids).
    x, forwards = list(prompt), 0
    while len(x) < len(prompt) + max_new:
        c = len(x)
        logits = model(torch.tensor([x + [MASK] * B]))[0].float()  # (c + B, V)
        logits[:, MASK] = float("-inf")  # the mask is never a candidate
        probs = logits.softmax(-1)
        conf, cand = probs[c - 1:c + B - 1].max(-1)  # slot i from position c + i - 1
        n = 1
        while n < B and tau < 1 and conf[n] >= tau:
            n += 1
        x += cand[:n].tolist()
        forwards += 1
    return x[len(prompt):len(prompt) + max_new], forwards


# ---- the reference decoder ----

@pytest.mark.parametrize("tau", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_uncached_decoder_follows_section_6(tau):
    model = tiny_model(1)
    ps = prompts()
    for p in ps:
        reference = decode_naive(model, p, MASK, set(), Options(tau=tau, B=4, max_new_tokens=21))
        assert reference == sliding_window(model, p, tau, 4, 21)
    assert decode(model, ps, MASK, set(), Options(tau=tau, B=4, max_new_tokens=21, cache="none")) == per_row(
        model, ps, set(), tau=tau, B=4, max_new_tokens=21)


def test_tau_one_is_greedy_ar_and_matches_transformers(hf_checkpoint):
    hf, path = hf_checkpoint(seed=3)
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    mask = hf.config.vocab_size - 1
    ps = prompts((5, 12, 2), seed=3)
    ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                       max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                       suppress_tokens=[mask])[0, len(p):].tolist()
           for p in ps]
    for p, r in zip(ps, ref):
        assert decode_naive(model, p, mask, set(), Options(tau=1.0, B=4, max_new_tokens=16)) == (r, 16)
    for cache in ("none", "cursor", "block"):
        out, forwards = decode(model, ps, mask, set(), Options(tau=1.0, B=4, max_new_tokens=16, cache=cache, K=5))
        assert out == ref and forwards == [16] * 3, cache


# ---- the caches reproduce the reference exactly (§7) ----

@pytest.mark.parametrize("tau", [0.5, 0.7, 0.9])
def test_cache_modes_equal_the_uncached_reference(tau):
    model, ps, stops = tiny_model(1), prompts(), {13}
    ref, ref_forwards = per_row(model, ps, stops, tau=tau, B=4, max_new_tokens=30)
    # Acceptance is ragged: rows take different numbers of tokens per forward, strictly between 1 and B.
    tpf = [len(o) / f for o, f in zip(ref, ref_forwards)]
    assert len(set(tpf)) > 1 and any(1 < x < 4 for x in tpf), tpf
    for cache in ("none", "cursor"):
        opts = Options(tau=tau, B=4, max_new_tokens=30, cache=cache)
        assert decode(model, ps, MASK, stops, opts) == (ref, ref_forwards), cache
        for p, r in zip(ps, ref):  # batch == one at a time
            assert decode(model, [p], MASK, stops, opts)[0] == [r]


@pytest.mark.parametrize("tau,K", [(0.5, 8), (0.7, 5), (0.9, 3), (0.6, 16)])
def test_block_cache_equals_reference_with_the_same_blocks(tau, K):
    model, ps, stops = tiny_model(1), prompts(), {13}
    ref, ref_forwards = per_row(model, ps, stops, tau=tau, B=4, max_new_tokens=30, K=K)
    opts = Options(tau=tau, B=4, max_new_tokens=30, cache="block", K=K)
    assert decode(model, ps, MASK, stops, replace(opts, cache="none")) == (ref, ref_forwards)
    calls, steps = [], {b: [] for b in range(len(ps))}  # row -> the forwards it accepted tokens in
    hidden = model.hidden
    model.hidden = lambda *a, **kw: calls.append(1) or hidden(*a, **kw)
    out, forwards = decode(model, ps, MASK, stops, opts, on_accept=lambda row, new: steps[row].append(len(calls)))
    assert (out, forwards) == (ref, ref_forwards)
    # Rows really waited for each other at block ends: some row sat out forwards between its steps.
    assert any(s != list(range(s[0], s[0] + len(s))) for s in steps.values())
    for p, r in zip(ps, ref):
        assert decode(model, [p], MASK, stops, opts)[0] == [r]


@pytest.mark.parametrize("cache", ["none", "cursor"])
def test_finished_rows_leave_the_batch(cache):
    # A row that stopped is no longer forwarded: forward j carries exactly the rows still decoding.
    model, ps, stops = tiny_model(1), prompts(), {13}
    ref, ref_forwards = per_row(model, ps, stops, tau=0.7, B=4, max_new_tokens=30)
    rows, hidden = [], model.hidden
    model.hidden = lambda x, *a, **kw: rows.append(x.shape[0]) or hidden(x, *a, **kw)
    assert decode(model, ps, MASK, stops, Options(tau=0.7, B=4, max_new_tokens=30, cache=cache)) == (ref, ref_forwards)
    assert rows == [sum(f > j for f in ref_forwards) for j in range(max(ref_forwards))]
    assert rows[-1] < len(ps)  # some row did leave early


def test_some_rows_stop_early_in_the_batch_tests():
    # Guards the two tests above: stop id 13 ends some rows mid-run and not others.
    out, _ = per_row(tiny_model(1), prompts(), {13}, tau=0.7, B=4, max_new_tokens=30)
    ended = [o[-1] == 13 and len(o) < 30 for o in out]
    assert any(ended) and not all(ended)


# ---- the acceptance rule (§6) ----

@pytest.mark.parametrize("cache", ["none", "cursor", "block"])
def test_forward_count_and_block_boundaries(cache):
    # tau = 0 accepts whole windows: B=4 and 10 new tokens take steps of 4, 4, 2 (3 forwards, the
    # prompt's included); K=6 blocks cut that to 4, 2, 4; K=3 to 3, 3, 3, 1.
    model, p = tiny_model(1, sharpen=1.0), prompts((7,))[0]
    for K, steps in [(0, [4, 4, 2]), (6, [4, 2, 4]), (3, [3, 3, 3, 1])]:
        if cache == "block" and not K or cache == "cursor" and K:
            continue
        sizes, stats = [], Stats()
        out, forwards = decode(model, [p], MASK, set(), Options(tau=0.0, B=4, max_new_tokens=10, cache=cache, K=K),
                               on_accept=lambda row, new, sizes=sizes: sizes.append(len(new)), stats=stats)
        assert sizes == steps and forwards == [len(steps)] and len(out[0]) == 10
        # after the prompt's forward each step feeds at least its B slots (the block cache re-feeds its block too)
        assert stats.steps == [len(steps) - 1] and stats.positions[0] >= 4 * (len(steps) - 1)
        assert out[0] == decode_naive(model, p, MASK, set(), Options(tau=0.0, B=4, max_new_tokens=10, K=K))[0]


def test_slot_zero_always_accepted():
    # With tau above every confidence the model reaches, each step still makes one token: plain AR.
    model, ps = tiny_model(1, sharpen=1.0), prompts()
    ar, _ = per_row(model, ps, set(), tau=1.0, B=4, max_new_tokens=12)
    probs = model(torch.tensor([ps[1] + ar[1]]))[0].float().softmax(-1)
    assert probs.max() < 0.99
    for cache in ("none", "cursor"):
        assert decode(model, ps, MASK, set(), Options(tau=0.99, B=4, max_new_tokens=12, cache=cache)) == (ar, [12] * 4)


def test_an_empty_prompt_is_refused_and_no_new_tokens_takes_no_forward():
    # Slot 0 is read at the prompt's last token: without one, the reference never emits and decode would read
    # slot 0 at a mask. A budget of 0 tokens emits nothing, as the reference does.
    model = tiny_model(1)
    with pytest.raises(ValueError, match="prompt 1 of 2 is empty"):
        decode(model, [[5], []], MASK, set(), Options())
    with pytest.raises(ValueError, match="prompt 0 of 1 is empty"):
        decode_naive(model, [], MASK, set(), Options())
    for kw in ({}, {"verify": True}, {"cache": "block", "K": 4}, {"cache": "none"}):
        assert decode(model, prompts((3, 5)), MASK, set(), Options(max_new_tokens=0, **kw)) == ([[], []], [0, 0]), kw
    assert decode_naive(model, [5], MASK, set(), Options(max_new_tokens=0)) == ([], 0)
    for bad in ({"B": 0}, {"K": -1}):  # no window at all would never move a row on
        with pytest.raises(ValueError, match=r"B must be at least 1 and K at least 0"):
            Options(**bad)
    stats = Stats([], [], [], [])  # eval reads a row's positions fed and steps from it
    decode(model, prompts((3, 5)), MASK, set(), Options(max_new_tokens=0, verify=True), stats=stats)
    assert stats == Stats([0, 0], [0, 0], [0, 0], [0, 0])


def test_stop_in_the_middle_of_a_window_is_trimmed():
    model, p = tiny_model(1), prompts((9,))[0]
    out, _ = decode(model, [p], MASK, set(), Options(tau=0.0, B=4, max_new_tokens=16))
    # The first token at a slot 1 or 2 of a later window that did not appear before it.
    i = next(i for i in range(4, 16) if i % 4 in (1, 2) and out[0][i] not in out[0][:i])
    for cache in ("none", "cursor", "block"):
        got, forwards = decode(model, [p], MASK, {out[0][i]},
                               Options(tau=0.0, B=4, max_new_tokens=16, cache=cache, K=16))
        assert got == [out[0][:i + 1]] and forwards == [i // 4 + 1], cache


def test_sampling():
    # The confidence of a sampled token is its probability; top-p keeps the nucleus only.
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(500, 1)
    probs = logits.softmax(-1)
    tok, conf = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(conf, probs.gather(-1, tok[:, None])[:, 0]) and len(set(tok.tolist())) == 4
    tok, conf = sample(logits, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {1, 2}  # 0.665 of the mass is in token 2 alone, 0.91 with token 1

    model, ps = tiny_model(1), prompts()
    opts = Options(tau=0.5, B=4, max_new_tokens=20, temperature=1.0)
    first = decode(model, ps, MASK, set(), opts, torch.Generator().manual_seed(0))
    assert first == decode(model, ps, MASK, set(), opts, torch.Generator().manual_seed(0))
    assert first != decode(model, ps, MASK, set(), opts, torch.Generator().manual_seed(1))
    # A vanishing nucleus is the argmax with probability 1: greedy tokens, whole windows accepted.
    nucleus = decode(model, ps, MASK, set(), replace(opts, top_p=1e-6), torch.Generator())
    assert nucleus == decode(model, ps, MASK, set(), Options(tau=0.0, B=4, max_new_tokens=20))


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    # (..., V) -> the distribution a token is drawn from: softmax(logits / T), cut to the smallest
    # set of most likely tokens whose mass reaches top_p, renormalised. Written out independently.
    p = (logits.float() / temperature).softmax(-1)
    sorted_p, order = p.sort(-1, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p < top_p)
    q = torch.where(keep, p, 0.0)
    return q / q.sum(-1, keepdim=True)


def test_sampled_confidence_is_the_probability_after_temperature_and_top_p():
    # Under sampling, a slot's confidence (the number tau is compared with) is the drawn token's
    # probability in the distribution it was drawn from: after temperature and top-p, not the raw
    # softmax. One pinned choice; docs/method.md §6 says only "the drawn token's probability".
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).repeat(400, 1)
    q = nucleus(logits[:1], 1.5, 0.8)[0]  # 0.56, 0.29, 0.15, 0, 0
    tok, conf = sample(logits, 1.5, 0.8, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1, 2}
    assert torch.allclose(conf, q[tok], atol=1e-6)
    assert (conf - logits.softmax(-1).gather(-1, tok[:, None])[:, 0]).abs().min() > 0.02  # not the raw softmax

    # The same through a decode step with a greedy row and a sampling row side by side (two groups with
    # their own temperatures, as the server mixes them). tau = 0 accepts every slot: every drawn token is seen.
    model, seqs, seen = tiny_model(1), prompts((5, 9)), []
    accept_count = generate.accept_count
    generate.accept_count = lambda conf, *rule: seen.append(conf.clone()) or accept_count(conf, *rule)
    try:
        groups = [Group([0], Options(tau=0.0)),
                  Group([1], Options(tau=0.0, temperature=2.0, top_p=0.9), torch.Generator().manual_seed(0))]
        new = decode_step(model, seqs, [4, 4], [None, None], None, groups, MASK, set()).new
    finally:
        generate.accept_count = accept_count
    conf = torch.cat(seen)  # one call per group, in row order
    for b, (seq, temperature) in enumerate(zip(seqs, [0.0, 2.0])):
        with torch.no_grad():
            logits = model(torch.tensor([seq + [MASK] * 3]))[0, len(seq) - 1:]  # slots 0..3
        logits[:, MASK] = float("-inf")
        dist = logits.softmax(-1) if temperature == 0 else nucleus(logits, temperature, 0.9)
        drawn = torch.tensor(new[b])
        if temperature == 0:
            assert torch.equal(drawn, logits.argmax(-1))
        assert torch.allclose(conf[b], dist.gather(-1, drawn[:, None])[:, 0], atol=1e-6)
    assert not torch.allclose(conf[1], logits.softmax(-1).gather(-1, drawn[:, None])[:, 0], atol=1e-3)


# ---- CLI ----

@pytest.fixture
def ckpt(tmp_path):
    model, tok = tiny_checkpoint(tmp_path / "ckpt", spread=0, sharpen=40,  # confident: several tokens per step
                                 max_position_embeddings=128)  # a context that test_cli_bad_arguments fills
    return tmp_path / "ckpt", model, tok


def test_cli_json_matches_the_reference(ckpt, tmp_path, capsys):
    path, model, tok = ckpt
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "two"}\n\n{"messages": [{"role": "user", "content": "three"}]}\n')
    main(["--ckpt", str(path), "--prompt", "one", "--prompts", str(file), "--json", "--batch-size", "2",
          "--max-new-tokens", "12", "--threshold", "0.5", "--device", "cpu"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 4
    for line, text in zip(lines, ["one", "two", "three"]):
        p = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        out, forwards = decode_naive(model, p, tok.mask_id, tok.stop_ids, Options(tau=0.5, B=4, max_new_tokens=12))
        assert line["prompt_ids"] == p and line["output_ids"] == out and line["forwards"] == forwards
        assert line["tokens_per_forward"] == len(out) / forwards
        assert line["text"] == tok.decode([t for t in out if t not in tok.stop_ids])
    summary = lines[-1]["summary"]
    assert summary["prompts"] == 3 and summary["new_tokens"] == sum(len(x["output_ids"]) for x in lines[:3])
    assert summary["tokens_per_forward"] > 1 and summary["seconds"] > 0

    main(["--ckpt", str(path), "--prompt", "one", "--raw", "--json", "--max-new-tokens", "5", "--cache", "block"])
    assert json.loads(capsys.readouterr().out.splitlines()[0])["prompt_ids"] == tok.encode("one")


def test_cli_streams_a_single_prompt(ckpt, capsys):
    path, model, tok = ckpt
    main(["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "12", "--cache", "none"])
    captured = capsys.readouterr()
    p = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    out, forwards = decode_naive(model, p, tok.mask_id, tok.stop_ids, Options(tau=0.9, B=4, max_new_tokens=12))
    assert captured.out.startswith(tok.decode([t for t in out if t not in tok.stop_ids]).rstrip("\ufffd"))
    assert f"new tokens {len(out)} | forwards {forwards} |" in captured.err and "first token" in captured.err


@pytest.mark.parametrize("args,status,message", [
    (["--threshold", "1.5"], 2, r"--threshold 1.5 is outside \[0, 1\]"),
    (["--block-size", "-1"], 2, r"--block-size -1 must be in 1..32 \(or 0: the checkpoint.s own\)"),
    (["--block-size", "1000"], 2, r"--block-size 1000 must be in 1..32 \(or 0: the checkpoint.s own\); a verify step"),
    (["--block-cache-size", "8"], 2, "--block-cache-size 8: needs a positive size and --cache block"),
    (["--prompt", "ok", " "], 1, "--prompt 2: empty prompt; give it some text"),
    (["--raw", "--prompt", ""], 1, "--prompt 1: empty prompt; give it some text"),
    (["--max-new-tokens", "120"], 1,
     "--prompt 1: 2[0-9] tokens \\+ --max-new-tokens 120 exceed the model's context of 128"),
    (["--prompts", "missing.jsonl"], 1, "--prompts missing.jsonl: file not found"),
    (["--verify", "--threshold", "0.9"], 2, "--threshold 0.9 with --verify: verify emits exactly the greedy tokens"),
    (["--verify", "--cache", "block"], 2, "--verify with --cache block: verify needs --cache none or cursor"),
    (["--draft-min", "0.5"], 2, r"--draft-min 0.5: a confidence in \[0, 1\], and only with --verify"),
    (["--verify", "--draft-budget", "-3"], 2, "--draft-budget -3: auto, or positions per row"),
    (["--verify", "--draft-budget", "wide"], 2, "--draft-budget wide: auto, or positions per row"),
])
def test_cli_bad_arguments(ckpt, monkeypatch, capsys, args, status, message):
    # A bad flag is a usage error (status 2, one line on stderr); a bad prompt exits with its message (status 1).
    path, _, _ = ckpt
    monkeypatch.setattr(generate.Transformer, "from_pretrained", lambda *a, **kw: pytest.fail("loaded weights"))
    prompt = [] if "--prompt" in args else ["--prompt", "hello"]
    argv = ["--ckpt", str(path), "--max-new-tokens", "16", *prompt, *args]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert (e.value.code == 2) == (status == 2)
    assert re.search(message, capsys.readouterr().err if status == 2 else e.value.code)


def test_cli_bad_files(ckpt, tmp_path, monkeypatch):
    path, _, _ = ckpt
    monkeypatch.setattr(generate.Transformer, "from_pretrained", lambda *a, **kw: pytest.fail("loaded weights"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"messages": "not a list"}\n')
    with pytest.raises(SystemExit, match=f"{bad}:2: expected"):
        main(["--ckpt", str(path), "--prompts", str(bad), "--max-new-tokens", "16"])
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    with pytest.raises(SystemExit, match=f"{bad}:2: not valid JSON"):
        main(["--ckpt", str(path), "--prompts", str(bad), "--max-new-tokens", "16"])
    bad.write_text('{"prompt": "fine"}\n\n{"messages": [{"role": "bot", "content": "hi"}]}\n')
    with pytest.raises(SystemExit, match=f"{bad}:3: messages\\[0\\] has role 'bot'"):
        main(["--ckpt", str(path), "--prompts", str(bad), "--max-new-tokens", "16"])

    monkeypatch.chdir(tmp_path)  # no runs/demo/mars here
    with pytest.raises(SystemExit, match="no checkpoint at runs/demo/mars: run `make demo`"):
        main(["--prompt", "hi"])
    (path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit, match="config.json:1: not valid JSON"):
        main(["--ckpt", str(path), "--prompt", "hi"])
    (path / "config.json").unlink()
    with pytest.raises(SystemExit, match="config.json not found"):
        main(["--ckpt", str(path), "--prompt", "hi"])


def test_cli_verify_reports_drafts_and_streams(ckpt, capsys):
    path, model, tok = ckpt
    main(["--ckpt", str(path), "--prompt", "one", "two", "--json", "--verify", "--verify-layout", "chain",
          "--max-new-tokens", "12", "--device", "cpu"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for line, text in zip(lines, ["one", "two"]):
        p = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        stats = Stats()
        opts = Options(B=4, max_new_tokens=12, verify=True, layout="chain", vocab_size=tok.vocab_size)
        _, forwards = decode(model, [p], tok.mask_id, tok.stop_ids, opts, stats=stats)
        (offered,), (accepted,) = stats.offered, stats.accepted
        greedy_ids, _ = decode_naive(model, p, tok.mask_id, tok.stop_ids, Options(tau=1.0, B=4, max_new_tokens=12))
        assert line["output_ids"] == greedy_ids
        assert line["forwards"] == forwards[0] and line["tokens_per_forward"] == len(line["output_ids"]) / forwards[0]
        assert (line["drafts_offered"], line["drafts_accepted"]) == (offered, accepted) and offered > 0
        assert line["acceptance_rate"] == accepted / offered
    summary = lines[-1]["summary"]
    assert summary["drafts_offered"] == sum(x["drafts_offered"] for x in lines[:2])

    main(["--ckpt", str(path), "--prompt", "hi", "--verify", "--max-new-tokens", "12", "--cache", "none", "--verbose"])
    captured = capsys.readouterr()
    p = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    out, _ = decode_naive(model, p, tok.mask_id, tok.stop_ids, Options(tau=1.0, B=4, max_new_tokens=12))
    assert captured.out.startswith(tok.decode([t for t in out if t not in tok.stop_ids]).rstrip("\ufffd"))
    assert "drafts accepted" in captured.err and "'verify': True" in captured.err


def test_cli_prints_the_settings_only_with_verbose(ckpt, capsys):
    # Quiet by default: stdout is the reply, stderr the run's one summary line. --verbose adds the resolved
    # settings (the device auto chose, the checkpoint's B, the dtype) on stderr, and the reply is the same.
    path, _, _ = ckpt
    argv = ["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "6", "--threshold", "0.5"]
    main(argv)
    quiet = capsys.readouterr()
    main(argv + ["--verbose"])
    loud = capsys.readouterr()
    assert quiet.out == loud.out and not [line for line in quiet.err.splitlines() if line.startswith("{")]
    (printed,) = [ast.literal_eval(line) for line in loud.err.splitlines() if line.startswith("{")]
    assert printed["verbose"] and printed["threshold"] == 0.5 and printed["max_new_tokens"] == 6
    assert printed["device"] in ("cpu", "cuda") and printed["block_size"] == 4 and printed["block_cache_size"] == 0
    assert printed["dtype"] == ("torch.float32" if printed["device"] == "cpu" else "torch.bfloat16")  # --dtype auto


def test_mask_and_spare_rows_are_never_candidates():
    # As in Qwen2.5: the tokenizer's ids end with the mask (60 here), the embedding has spare rows
    # after it (61..63). Make the mask row and a spare row win every argmax: neither may be emitted.
    model, mask, vocab = tiny_model(1), 60, 61
    with torch.no_grad():
        model.model.embed_tokens.weight[[mask, 62]] *= 50
    ps = [[t % mask for t in p] for p in prompts((4, 9))]
    for cache in ("none", "cursor", "block"):
        outs, _ = decode(model, ps, mask, set(),
                         Options(tau=0.5, B=4, max_new_tokens=12, cache=cache, K=8, vocab_size=vocab))
        assert all(len(o) == 12 and max(o) < mask for o in outs), cache
    out, _ = decode_naive(model, ps[0], mask, set(), Options(tau=0.5, B=4, max_new_tokens=12, vocab_size=vocab))
    assert len(out) == 12 and max(out) < mask
    # Without the rule the argmax would be the mask: the test can fail.
    assert model(torch.tensor([ps[0] + [mask]]))[0, -1].argmax().item() in (mask, 62)


def test_tau_one_feeds_no_masks():
    # tau = 1 accepts one token per step, so the step is a plain AR step: no mask is ever forwarded.
    model, seen = tiny_model(1), []
    hidden = model.hidden
    model.hidden = lambda x, *a, **k: seen.append(x) or hidden(x, *a, **k)
    for cache in ("none", "cursor"):
        seen.clear()
        out, f = decode(model, prompts((6,)), MASK, set(), Options(tau=1.0, B=4, max_new_tokens=8, cache=cache))
        assert f == [8] and all((x != MASK).all() for x in seen), cache
    seen.clear()
    decode(model, prompts((6,)), MASK, set(), Options(tau=0.9, B=4, max_new_tokens=8, cache="cursor"))
    assert any((x == MASK).any() for x in seen)  # and below 1 the window does carry masks


def test_a_calibration_map_in_the_checkpoint_is_ignored_with_one_note(ckpt, capsys):
    # Calibrated thresholds were removed (docs/method.md §16): a checkpoint that still carries its map, even a
    # broken one, decodes exactly as without it, and one line on stderr says the file is ignored.
    path, _, _ = ckpt
    args = ["--prompt", "hi", "--max-new-tokens", "8", "--json", "--threshold", "0.7", "--device", "cpu"]
    main(["--ckpt", str(path), *args])
    alone = capsys.readouterr()
    # a map that sends every confidence to 0.9 (it would accept every slot at tau 0.7), then a file that is no map
    for body in ('{"version": 2, "slots": [{"lo": [0.0], "p": [0.9], "n": [3]}]}', "[]"):
        (path / "calibration.json").write_text(body)
        main(["--ckpt", str(path), *args])
        out = capsys.readouterr()
        assert out.out.splitlines()[0] == alone.out.splitlines()[0]  # the same tokens
        notes = [line for line in out.err.splitlines() if "calibration.json" in line]
        assert notes == [f"note: {path / 'calibration.json'} is ignored: calibrated thresholds were removed "
                         "(docs/method.md §16)"]


# ---- self-verification (§9): exactly the greedy tokens, several per forward ----

LAYOUTS = ("tree", "chain")


@contextlib.contextmanager
def one_thread():
    # Matrices this small gain nothing from a second thread, and lose much when the other core is busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def counting_model() -> Transformer:
    # tiny_model(0, sharpen=1.0) trained for a few MARS steps (docs/method.md §2-4) on counting by 1 or 2 from a prompt
    # [step, start]: the masks learn part of the pattern, so drafts are sometimes right.
    from data import make_batch
    from train import mars_loss

    model, rng = tiny_model(0, sharpen=1.0).train(), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    with one_thread():
        for _ in range(80):
            rows = []
            for s, x0 in zip(torch.randint(1, 3, (16,), generator=rng).tolist(),
                             torch.randint(0, 60, (16,), generator=rng).tolist()):
                ids = [s, x0] + [(x0 + s * i) % 60 for i in range(1, 19)]
                rows.append((torch.tensor(ids).numpy(), torch.tensor([False] * 2 + [True] * 18).numpy()))
            loss, _, _ = mars_loss(model, make_batch(rows, 4, MASK, 62, "mars"))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def counter() -> Transformer:
    return counting_model()


def verify_prompts(n: int, seed: int) -> list[list[int]]:
    # Ragged: lengths 1 to 40, both ends included; the first prompts are the counting task's own.
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 40] + torch.randint(1, 41, (max(n - 2, 0),), generator=g).tolist()
    own = [[1 + i % 2, 7 * i % 60] for i in range(n // 2)]
    return (own + prompts(lengths, seed))[:n]


def greedy(model, ps, stops, max_new) -> list[list[int]]:
    return per_row(model, ps, stops, tau=1.0, B=4, max_new_tokens=max_new)[0]


@pytest.mark.parametrize("cache", ["none", "cursor"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_equals_greedy_decoding(counter, cache, layout):
    # Every batch size from 1 to 8, ragged prompts, stop id 13, the max_new_tokens cut; the model's masks
    # untrained (tiny) or partly trained (counter). tau plays no part in verify mode.
    drafted_stops = 0
    for model in (tiny_model(1), counter):
        offered = accepted = 0
        for R in range(1, 9):
            ps = verify_prompts(R, seed=R)
            ref = greedy(model, ps, {13}, 24)
            stats = Stats()
            opts = Options(tau=0.3, B=4, max_new_tokens=24, cache=cache, verify=True, layout=layout)
            out, forwards = decode(model, ps, MASK, {13}, opts, stats=stats)
            assert out == ref, (R, cache, layout)
            # Each forward emits one token plus the drafts it accepted (§6's count, the prompt's forward included),
            # but one whose accepted drafts end at the stop token emits nothing after it.
            ends = [len(o) - f - a for o, f, a in zip(out, forwards, stats.accepted)]
            assert all(e == 0 or (e == -1 and o[-1] == 13) for e, o in zip(ends, out)), ends
            drafted_stops += ends.count(-1)
            assert all(0 <= a <= n <= 3 * f for f, n, a in zip(forwards, stats.offered, stats.accepted))
            offered, accepted = offered + sum(stats.offered), accepted + sum(stats.accepted)
            if R in (3, 8):  # a batch equals its prompts decoded one at a time, forwards and drafts too
                alone = [decode(model, [p], MASK, {13}, replace(opts, tau=1.0)) for p in ps]
                assert out == [o[0] for o, _ in alone] and forwards == [f[0] for _, f in alone]
        assert 0 < accepted < offered  # some drafts are right, most are not: both paths run
    assert drafted_stops > 0  # a stop accepted as a draft counts as one


def test_verify_rows_stop_early_and_hit_the_cut():
    # Guards the test above: with stop id 13 some rows end early, others run to max_new_tokens.
    out = greedy(tiny_model(1), verify_prompts(8, seed=8), {13}, 24)
    assert any(o[-1] == 13 and len(o) < 24 for o in out) and any(len(o) == 24 for o in out)


def test_verify_matches_transformers_greedy(hf_checkpoint):
    # Any checkpoint, never MARS-trained: its masks propose noise, and the text is still greedy AR.
    hf, path = hf_checkpoint(seed=5)
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    mask = hf.config.vocab_size - 1
    ps = prompts((6, 11, 3), seed=5)
    for layout in LAYOUTS:
        out, _ = decode(model, ps, mask, set(), Options(B=4, max_new_tokens=12, verify=True, layout=layout))
        for p, o in zip(ps, out):
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                              suppress_tokens=[mask])[0, len(p):].tolist()
            assert o == ref, layout


def test_the_lm_head_runs_once_a_step_while_rows_times_positions_are_few(counter, monkeypatch):
    # mars.verify.HEAD_ROWS: a verify step whose rows x fed positions are at most it calls the LM head once,
    # over every fed position; with it at 0, the full tree's steps call it twice (the slots, then the next
    # masks). The tokens and the forwards are the same either way.
    ps = verify_prompts(2, seed=3)  # the counting task's own prompts: 2 tokens, so 2 x 16 positions at most
    head, calls, few = Transformer.head, [], mars.verify.HEAD_ROWS
    monkeypatch.setattr(Transformer, "head", lambda self, h: calls.append(h.shape[:-1].numel()) or head(self, h))
    runs = {}
    for rows in (few, 0):
        monkeypatch.setattr(mars.verify, "HEAD_ROWS", rows)
        calls.clear()
        out, forwards = decode(counter, ps, MASK, set(), Options(B=4, max_new_tokens=20, verify=True, layout="tree"))
        runs[rows] = out, forwards, list(calls)
    (out, forwards, once), (out0, forwards0, twice) = runs[few], runs[0]
    assert out == out0 == greedy(counter, ps, set(), 20) and forwards == forwards0
    assert len(once) == max(forwards) and max(once) <= few  # one call a step, over all of them
    assert len(twice) > 1.5 * len(once)


def verify_reference(model, prompt: list[int], B: int, max_new: int, layout: str) -> tuple[list[int], int, int]:
    # §9 written out on model.forward, uncached, one sequence, independent of generate.py. The group
    # after d_a runs as its own forward on [sequence + d_1..d_a + masks]: the positions and the context
    # the tree layout gives it inside the one forward that the step counts.
    def argmax(x):
        logits = model(torch.tensor([x]))[0].float()
        logits[:, MASK] = float("-inf")
        return logits.argmax(-1).tolist()

    out, d, forwards, accepted = [], [], 0, 0
    while len(out) < max_new:
        w = min(B, max_new - len(out))
        seq, d = prompt + out, d[:w - 1]
        v = argmax(seq + d)[len(seq) - 1:]  # v_1 .. v_{k+1}
        a = 0
        while a < len(d) and d[a] == v[a]:
            a += 1
        out += v[:a + 1]
        forwards, accepted = forwards + 1, accepted + a
        d = argmax(seq + d[:a] + [MASK] * (w - 1))[len(seq) + a:] if layout == "tree" or a == len(d) else []
    return out, forwards, accepted


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_counts_forwards_and_drafts_as_section_9(counter, layout):
    ps = verify_prompts(4, seed=11)
    stats = Stats()
    out, forwards = decode(counter, ps, MASK, set(), Options(B=4, max_new_tokens=20, verify=True, layout=layout),
                           stats=stats)
    refs = [verify_reference(counter, p, 4, 20, layout) for p in ps]
    assert out == [o for o, _, _ in refs] and forwards == [f for _, f, _ in refs]
    assert stats.accepted == [a for _, _, a in refs]
    assert max(len(o) / f for o, f in zip(out, forwards)) > 1.3  # a counting prompt: several tokens per forward


def force_drafts(monkeypatch, propose) -> None:
    # Replaces every draft a verify step proposes with propose(the row's sequence after this step).
    step = generate.decode_step

    def forced(model, seqs, w, *args, **kw):
        out = step(model, seqs, w, *args, **kw)
        return out._replace(drafts=[n if n is None else Drafts(propose(s + t))
                                    for s, t, n in zip(seqs, out.new, out.drafts)])
    monkeypatch.setattr(generate, "decode_step", forced)


@pytest.mark.parametrize("cache", ["none", "cursor"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_with_forced_drafts(monkeypatch, cache, layout):
    model, ps, stops, B = tiny_model(1), verify_prompts(5, seed=3), {13}, 4
    ref = greedy(model, ps, stops, 23)
    full = [p + o for p, o in zip(ps, ref)]

    def truth(seq):  # the greedy tokens that follow seq
        f = next(f for f in full if f[:len(seq)] == seq)
        return f[len(seq):len(seq) + B - 1]

    # Forced wrong: every draft differs from the greedy token. The output is still exact, one token per forward.
    force_drafts(monkeypatch, lambda seq: [(t + 1) % MASK for t in truth(seq)])
    stats = Stats()
    opts = Options(B=B, max_new_tokens=23, cache=cache, verify=True, layout=layout)
    out, forwards = decode(model, ps, MASK, stops, opts, stats=stats)
    assert out == ref and forwards == [len(o) for o in ref]
    # one row stops at once
    assert all(a == 0 and (n > 0 or len(o) == 1) for n, a, o in zip(stats.offered, stats.accepted, ref))
    # Forced right: after the prompt's forward, which has no drafts yet, every step emits B tokens, until
    # the stop token or the max_new_tokens cut ends the row.
    force_drafts(monkeypatch, truth)
    sizes = {b: [] for b in range(len(ps))}
    out, forwards = decode(model, ps, MASK, stops, opts, on_accept=lambda row, new: sizes[row].append(len(new)))
    assert out == ref
    for o, s in zip(ref, sizes.values()):
        assert s == [1] + [min(B, len(o) - i) for i in range(1, len(o), B)], (o, s)


def test_verify_ignores_tau_and_draft_min_only_changes_speed(counter):
    ps, seen = verify_prompts(6, seed=4), []
    hidden = counter.hidden
    counter.hidden = lambda x, *a, **k: seen.append(x.shape[1]) or hidden(x, *a, **k)
    try:
        runs = {}
        for tau, floor in [(0.0, 0.0), (1.0, 0.0), (0.5, 0.6), (0.5, 1.0)]:
            seen.clear()
            stats = Stats()
            opts = Options(tau=tau, B=4, max_new_tokens=20, verify=True, draft_min=floor)
            out, forwards = decode(counter, ps, MASK, set(), opts, stats=stats)
            runs[tau, floor] = out, forwards, sum(stats.offered), sum(seen)
    finally:
        del counter.hidden
    ref = greedy(counter, ps, set(), 20)
    assert all(out == ref for out, _, _, _ in runs.values())
    assert runs[0.0, 0.0][1:] == runs[1.0, 0.0][1:]  # the same forwards, drafts and positions
    # A floor cuts the drafts (fewer offered, fewer positions fed); at 1.0 hardly any draft is left.
    base, cut, none = runs[0.0, 0.0], runs[0.5, 0.6], runs[0.5, 1.0]
    assert base[2] > cut[2] > none[2] and base[3] > cut[3] > none[3]
    assert sum(none[1]) >= sum(map(len, ref)) - 6


def test_verify_rejects_the_block_cache_and_unknown_layouts():
    with pytest.raises(AssertionError, match="the block cache needs K >= 1 and cannot commit verified drafts"):
        decode(tiny_model(1), prompts((3,)), MASK, set(), Options(cache="block", K=8, verify=True))
    with pytest.raises(AssertionError, match="layout='star': choose tree or chain"):
        decode(tiny_model(1), prompts((3,)), MASK, set(), Options(verify=True, layout="star"))


# ---- sampling with verify: the speculative-sampling rule (§9), tested by distribution ----

def first_three(model, prompt: list[int], mask: int) -> torch.Tensor:
    # P(x1, x2, x3) of sequential sampling at temperature 1 (tau = 1), exactly: (V, V, V) over the real tokens.
    V = mask

    def probs(contexts):
        logits = model(torch.tensor(contexts))[:, -1].float()
        return logits[:, :V].softmax(-1)  # the mask (the last row) is never a candidate
    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in range(V)])
    p3 = probs([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    # Pearson's test; cells expecting fewer than 5 draws are pooled. Returns the p-value.
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2), stat / 2).item()


def sampled_verify(layout: str, B: int, N: int = 6000, budget: int = 0) -> tuple[float, float]:
    # N seeded draws of the first 3 tokens (a batch of N copies of one prompt; each row draws its own)
    # -> (p-value against sequential sampling, share of drafts accepted). Vocabulary: 4 tokens and the
    # mask; flat distributions, so drafts are often rejected and the residual draws run.
    model, mask, prompt, stats = tiny_model(2, vocab_size=5, sharpen=0.3), 4, [0, 1, 2], Stats()
    with one_thread():
        opts = Options(B=B, max_new_tokens=4, temperature=1.0, verify=True, layout=layout, draft_budget=budget)
        out, _ = decode(model, [prompt] * N, mask, set(), opts, torch.Generator().manual_seed(0), stats=stats)
        expected = N * first_three(model, prompt, mask).flatten()
    counts = torch.bincount(torch.tensor([16 * o[0] + 4 * o[1] + o[2] for o in out]), minlength=64).float()
    return chi_square_p(counts, expected), sum(stats.accepted) / sum(stats.offered)


@pytest.mark.parametrize("layout,B,budget", [("tree", 2, 0), ("chain", 2, 0), ("tree", 4, 0), ("chain", 4, 0),
                                             ("tree", 4, 4)])
def test_sampled_verify_matches_sequential_sampling(layout, B, budget):
    p, acceptance = sampled_verify(layout, B, budget=budget)
    assert p > 1e-3 and 0.3 < acceptance < 0.9, (p, acceptance)


def test_the_distribution_test_fails_wrong_rules(monkeypatch):
    # The same test with the rule broken two ways: accepting a draft by its confidence (as a threshold
    # would), and drawing a rejected draft's replacement from p instead of max(0, p - q).
    def by_confidence(p, q, d, generator=None):
        qd = q.gather(-1, d.clamp(min=0)[..., None])[..., 0]
        a = ((d >= 0) & (qd >= 0.3)).long().cumprod(dim=1).sum(dim=1)
        fix = torch.multinomial(p.flatten(0, 1), 1, generator=generator).view(p.shape[:2])
        return a, torch.where(torch.arange(p.shape[1]) < a[:, None], torch.nn.functional.pad(d, (0, 1)), fix)

    def from_p(p, q, d, generator=None):
        a, tok = speculative(p, q, d, generator)
        fix = torch.multinomial(p.flatten(0, 1), 1, generator=generator).view(p.shape[:2])
        return a, torch.where(torch.arange(p.shape[1]) < a[:, None], tok, fix)

    for wrong in (by_confidence, from_p):
        monkeypatch.setattr(mars.verify, "speculative", wrong)
        assert sampled_verify("tree", 4)[0] < 1e-6, wrong.__name__


# ---- seeds: a row's draws depend on its own generator and its own slots alone ----

def serve_like(model, requests, B: int = 4, max_new: int = 16) -> list[list[int]]:
    # Decodes requests as serve.py does: one cursor cache, one decode_step per step over every slot, a
    # request joining at its own step. A request: (prompt, joins at step, tau, temperature, seed or
    # None, verify); a seed gives the row its own generator, and so a group of its own.
    from generate import window
    from kvcache import KVCache

    R = len(requests)
    kv = KVCache(model.config, R, 64 + max_new + B * B, "cpu", torch.float32)
    gens = [torch.Generator().manual_seed(seed) if seed is not None else None for _, _, _, _, seed, _ in requests]
    out, drafts, done, step = [[] for _ in requests], [None] * R, [False] * R, 0
    while not all(done):
        live = [not done[b] and requests[b][1] <= step for b in range(R)]
        step += 1
        if not any(live):  # an idle server runs no step
            continue
        w = [window(len(out[b]), B, max_new, 0) if live[b] else 0 for b in range(R)]
        drafts = [(drafts[b] or Drafts()) if live[b] and requests[b][5] else None for b in range(R)]
        groups = {}
        for b, (_, _, tau, temperature, _, verify) in enumerate(requests):
            if live[b]:
                groups.setdefault((Options(tau=tau, temperature=temperature, verify=verify), gens[b]), []).append(b)
        new, kept, nxt, *_ = decode_step(model, [r[0] + o for r, o in zip(requests, out)], w, drafts, kv,
                                           [Group(rows, opts, g) for (opts, g), rows in groups.items()], MASK, {13})
        kv.commit(kept)
        for b in range(R):
            if live[b]:
                out[b] += new[b]
                drafts[b] = nxt[b]
                done[b] = new[b][-1] == 13 or len(out[b]) == max_new
    return out


@pytest.mark.parametrize("verify", [False, True])
def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch(verify):
    # The same seeded sampled request, alone, as one of 8 identical requests that join a step apart,
    # and beside unrelated rows (other prompts and lengths, greedy and threshold rows, another seed).
    model = tiny_model(1)
    p, others = prompts((6,), seed=6)[0], prompts((1, 30, 12, 3), seed=6)
    seeded = lambda joins: (p, joins, 0.4, 1.5, 7, verify)  # noqa: E731
    alone = serve_like(model, [seeded(0)])[0]
    assert len(alone) == 16  # no early stop: every step draws
    assert serve_like(model, [seeded(i) for i in range(8)]) == [alone] * 8
    neighbours = [(others[0], 0, 0.5, 0.0, None, False), (others[1], 1, 1.0, 0.0, None, True),
                  (others[2], 0, 0.3, 1.0, 3, not verify), (others[3], 2, 0.6, 1.2, 4, verify)]
    mixed = serve_like(model, [neighbours[0], neighbours[1], seeded(1), neighbours[2], neighbours[3]])
    assert mixed[2] == alone
    # The request is really sampled: another seed draws another text.
    assert serve_like(model, [(p, 0, 0.4, 1.5, 8, verify)])[0] != alone


@pytest.mark.parametrize("mode", ["threshold", "verify", "block"])
def test_decode_with_a_generator_per_prompt_gives_each_row_its_own_text(mode):
    # decode given one generator per prompt: a sampled row's text is the same alone and beside other rows, in
    # any order (generate.py seeds one per prompt from --seed, so --batch-size changes no text).
    model = tiny_model(1)
    ps = prompts((6, 1, 13), seed=3)
    opts = Options(tau=0.5, B=4, max_new_tokens=12, temperature=1.3, verify=mode == "verify",
                   cache="block" if mode == "block" else "cursor", K=8 if mode == "block" else 0)

    def gens(seeds):
        return [torch.Generator().manual_seed(x) for x in seeds]

    alone = [decode(model, [p], MASK, {13}, opts, gens([seed]))[0][0] for p, seed in zip(ps, (5, 6, 7))]
    assert decode(model, ps, MASK, {13}, opts, gens((5, 6, 7)))[0] == alone
    assert decode(model, ps[::-1], MASK, {13}, opts, gens((7, 6, 5)))[0] == alone[::-1]
    assert decode(model, ps[:1], MASK, {13}, opts, gens([8]))[0][0] != alone[0]  # sampled: another seed, another text


# ---- the draft budget (§9): which drafts and masks a tree step feeds ----

def test_budget_layout_keeps_the_positions_of_largest_gain_within_the_budget():
    g = torch.Generator().manual_seed(0)
    for G in (1, 3, 7):
        for k in range(G + 1):
            conf = torch.rand(k, generator=g).tolist()
            assert budget_layout(conf, G, 0) == (k, [G] * (k + 1))  # no budget: the full tree
            for N in range(1, G * (G + 2) + 2):
                drafts, sizes = budget_layout(conf, G, N)
                assert drafts <= k and len(sizes) == drafts + 1 and drafts + sum(sizes) == min(N, k + (k + 1) * G)
    # Confident drafts: the likeliest outcome is that all are accepted, so the group after d_3 comes first.
    assert budget_layout([0.9, 0.9, 0.9], 3, 6) == (3, [0, 0, 0, 3])
    # An unsure first draft: acceptance most likely stops at once, so only the group after u is fed.
    sizes = budget_layout([0.1, 0.9, 0.9], 3, 4)[1]
    assert sizes[0] > 0 and not any(sizes[1:])


@pytest.mark.parametrize("cache", ["none", "cursor"])
def test_every_draft_budget_gives_the_greedy_tokens_and_bounds_the_positions_fed(counter, cache):
    ps = verify_prompts(6, seed=5)  # ragged
    ref = greedy(counter, ps, {13}, 24)
    tree_fed = None
    for N in (1, 2, 3, 5, 8, 12, 0):
        stats = Stats()
        opts = Options(B=4, max_new_tokens=24, cache=cache, verify=True, draft_budget=N)
        out, _ = decode(counter, ps, MASK, {13}, opts, stats=stats)
        fed = list(zip(stats.positions, stats.steps))
        assert out == ref, N
        if cache == "cursor":  # after the prompt, a row feeds its one new token, then drafts and masks
            assert all(n <= (1 + (N or 15)) * s for n, s in fed), (N, fed)
            if N == 0:
                tree_fed = sum(n for n, _ in fed) / sum(s for _, s in fed)
            elif N <= 3:
                assert sum(n for n, _ in fed) / sum(s for _, s in fed) <= 1 + N
    if cache == "cursor":
        assert tree_fed > 4  # the full tree feeds more than a small budget does


# ---- lossy rules that read the base model (docs/method.md §9): base-checked verify ----

def test_a_step_accepts_slot_zero_then_slots_while_their_confidence_reaches_tau():
    conf = torch.tensor([[0.1, 0.95, 0.9, 0.2], [0.1, 0.5, 0.99, 0.99], [0.1, 0.99, 0.99, 0.99]])
    assert generate.accept_count(conf, 0.9).tolist() == [3, 1, 4]
    assert generate.accept_count(conf, 0.0).tolist() == [4, 4, 4]
    assert generate.accept_count(torch.ones(3, 4), 1.0).tolist() == [1, 1, 1]  # tau 1 is AR, even at conf 1.0


def test_base_checked_acceptance_keeps_near_choices_and_tolerance_one_is_exact(counter):
    from mars.verify import tolerated

    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]]])  # (1, W=3, V=3)
    d = torch.tensor([[1, 2]])  # p_1(1) = 0.3 = 0.6 x max; p_2(2) = 0.3 = 0.5 x max
    assert [x.tolist() for x in tolerated(p, d, 0.6)] == [[1], [[1, 1, 0]]]  # d_2 misses: then p_2's argmax
    assert [x.tolist() for x in tolerated(p, d, 0.5)] == [[2], [[1, 2, 0]]]
    assert [x.tolist() for x in tolerated(p, torch.tensor([[1, -1]]), 0.1)] == [[1], [[1, 1, 0]]]  # past d: none
    ps = verify_prompts(6, seed=4)
    ref = greedy(counter, ps, {13}, 24)
    assert decode(counter, ps, MASK, {13}, Options(B=4, max_new_tokens=24, verify=True, tolerance=1.0))[0] == ref
    out, _ = decode(counter, ps, MASK, {13}, Options(B=4, max_new_tokens=24, verify=True, tolerance=0.3))
    assert out != ref  # lossy: some draft the base rated highly, but not first, was kept
    for p_, o in zip(ps, out):  # every emitted token is one the base model rates >= 0.3 x its first choice
        probs = torch.softmax(counter(torch.tensor([p_ + o]))[0, len(p_) - 1:-1].float(), -1)
        probs[:, MASK] = 0
        chosen = probs.gather(1, torch.tensor(o)[:, None])[:, 0]
        assert (chosen >= 0.3 * probs.max(-1).values - 1e-5).all()


def test_a_tiny_temperature_samples_the_greedy_token():
    # logits / 1e-40 overflow float32, and 1e-300 is 0 there; with the top logit moved to 0 first and the
    # temperature at least MIN_TEMPERATURE, the softmax is the greedy one-hot, and the masked -inf stays
    # -inf instead of inf - inf = nan.
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    for t in (1e-300, 1e-40, 1e-30, 1e-8):
        probs = generate.distribution(logits, t)
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]])), t
        assert sample(logits, t, generator=torch.Generator().manual_seed(0))[0].item() == 1
    assert torch.allclose(generate.distribution(logits, 1.0), torch.softmax(logits, -1))  # unchanged at 1
