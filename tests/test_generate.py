# generate.py: MARS decoding (MARS.md §6) and its KV caches (§7). Every comparison is exact token
# equality in float32 on tiny random models.
import json
import re

import pytest
import torch

import generate
from generate import decode, decode_naive, main, sample
from model import Config, Transformer
from tokenizer import Tokenizer

MASK = 63  # the tiny models' mask id: their last vocabulary row


def tiny(seed: int = 1, sharpen: float = 3.0, **overrides) -> Transformer:
    # A random model whose embedding (= tied lm_head) is scaled up: its confidences spread over
    # (0, 1), so thresholds between 0.3 and 0.9 give ragged acceptance across rows.
    torch.manual_seed(seed)
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=512)
    model = Transformer(Config(**{**kw, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        model.model.embed_tokens.weight.mul_(sharpen)
    return model


def prompts(lengths=(3, 17, 40, 1), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK - 1, (n,), generator=g).tolist() for n in lengths]


def per_row(model, ps, stops, **kw) -> tuple[list[list[int]], list[int]]:
    # The oracle, one prompt at a time.
    runs = [decode_naive(model, p, MASK, stops, **kw) for p in ps]
    return [o for o, _ in runs], [f for _, f in runs]


def sliding_window(model, prompt, tau, B, max_new) -> tuple[list[int], int]:
    # MARS.md §6 written out directly on model.forward, independent of generate.py (no stop ids).
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
    model = tiny()
    ps = prompts()
    for p in ps:
        assert decode_naive(model, p, MASK, set(), tau, B=4, max_new_tokens=21) == sliding_window(model, p, tau, 4, 21)
    assert decode(model, ps, MASK, set(), tau, B=4, max_new_tokens=21, cache="none") == per_row(
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
        assert decode_naive(model, p, mask, set(), tau=1.0, B=4, max_new_tokens=16) == (r, 16)
    for cache in ("none", "step", "cursor", "block"):
        out, forwards = decode(model, ps, mask, set(), tau=1.0, B=4, max_new_tokens=16, cache=cache, block=5)
        assert out == ref and forwards == [16] * 3, cache


# ---- the caches reproduce the reference exactly (§7) ----

@pytest.mark.parametrize("tau", [0.5, 0.7, 0.9])
def test_cache_modes_equal_the_uncached_reference(tau):
    model, ps, stops = tiny(), prompts(), {13}
    ref, ref_forwards = per_row(model, ps, stops, tau=tau, B=4, max_new_tokens=30)
    # Acceptance is ragged: rows take different numbers of tokens per forward, strictly between 1 and B.
    tpf = [len(o) / f for o, f in zip(ref, ref_forwards)]
    assert len(set(tpf)) > 1 and any(1 < x < 4 for x in tpf), tpf
    for cache in ("none", "step", "cursor"):
        assert decode(model, ps, MASK, stops, tau, B=4, max_new_tokens=30, cache=cache) == (ref, ref_forwards), cache
        for p, r in zip(ps, ref):  # batch == one at a time
            assert decode(model, [p], MASK, stops, tau, B=4, max_new_tokens=30, cache=cache)[0] == [r]


@pytest.mark.parametrize("tau,K", [(0.5, 8), (0.7, 5), (0.9, 3), (0.6, 16)])
def test_block_cache_equals_reference_with_the_same_blocks(tau, K):
    model, ps, stops = tiny(), prompts(), {13}
    ref, ref_forwards = per_row(model, ps, stops, tau=tau, B=4, max_new_tokens=30, block=K)
    assert decode(model, ps, MASK, stops, tau, B=4, max_new_tokens=30, cache="none", block=K) == (ref, ref_forwards)
    calls, steps = [], {b: [] for b in range(len(ps))}  # row -> the forwards it accepted tokens in
    hidden = model.hidden
    model.hidden = lambda *a, **kw: calls.append(1) or hidden(*a, **kw)
    out, forwards = decode(model, ps, MASK, stops, tau, B=4, max_new_tokens=30, cache="block", block=K,
                           on_accept=lambda row, new: steps[row].append(len(calls)))
    assert (out, forwards) == (ref, ref_forwards)
    # Rows really waited for each other at block ends: some row sat out forwards between its steps.
    assert any(s != list(range(s[0], s[0] + len(s))) for s in steps.values())
    for p, r in zip(ps, ref):
        assert decode(model, [p], MASK, stops, tau, B=4, max_new_tokens=30, cache="block", block=K)[0] == [r]


def test_some_rows_stop_early_in_the_batch_tests():
    # Guards the two tests above: stop id 13 ends some rows mid-run and not others.
    out, _ = per_row(tiny(), prompts(), {13}, tau=0.7, B=4, max_new_tokens=30)
    ended = [o[-1] == 13 and len(o) < 30 for o in out]
    assert any(ended) and not all(ended)


# ---- the acceptance rule (§6) ----

@pytest.mark.parametrize("cache", ["none", "step", "cursor", "block"])
def test_forward_count_and_block_boundaries(cache):
    # tau = 0 accepts whole windows: B=4 and 10 new tokens take steps of 4, 4, 2 (3 forwards, the
    # prompt's included); K=6 blocks cut that to 4, 2, 4; K=3 to 3, 3, 3, 1.
    model, p = tiny(sharpen=1.0), prompts((7,))[0]
    for K, steps in [(0, [4, 4, 2]), (6, [4, 2, 4]), (3, [3, 3, 3, 1])]:
        if cache == "block" and not K or cache in ("step", "cursor") and K:
            continue
        sizes = []
        out, forwards = decode(model, [p], MASK, set(), tau=0.0, B=4, max_new_tokens=10, cache=cache,
                               block=K, on_accept=lambda row, new: sizes.append(len(new)))
        assert sizes == steps and forwards == [len(steps)] and len(out[0]) == 10
        assert out[0] == decode_naive(model, p, MASK, set(), tau=0.0, B=4, max_new_tokens=10, block=K)[0]


def test_slot_zero_always_accepted():
    # With tau above every confidence the model reaches, each step still makes one token: plain AR.
    model, ps = tiny(sharpen=1.0), prompts()
    ar, _ = per_row(model, ps, set(), tau=1.0, B=4, max_new_tokens=12)
    probs = model(torch.tensor([ps[1] + ar[1]]))[0].float().softmax(-1)
    assert probs.max() < 0.99
    for cache in ("none", "cursor"):
        assert decode(model, ps, MASK, set(), tau=0.99, B=4, max_new_tokens=12, cache=cache) == (ar, [12] * 4)


def test_stop_in_the_middle_of_a_window_is_trimmed():
    model, p = tiny(), prompts((9,))[0]
    out, _ = decode(model, [p], MASK, set(), tau=0.0, B=4, max_new_tokens=16)
    # The first token at a slot 1 or 2 of a later window that did not appear before it.
    i = next(i for i in range(4, 16) if i % 4 in (1, 2) and out[0][i] not in out[0][:i])
    for cache in ("none", "step", "cursor", "block"):
        got, forwards = decode(model, [p], MASK, {out[0][i]}, tau=0.0, B=4, max_new_tokens=16,
                               cache=cache, block=16)
        assert got == [out[0][:i + 1]] and forwards == [i // 4 + 1], cache


def test_sampling():
    # The confidence of a sampled token is its probability; top-p keeps the nucleus only.
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(500, 1)
    probs = logits.softmax(-1)
    tok, conf = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(conf, probs.gather(-1, tok[:, None])[:, 0]) and len(set(tok.tolist())) == 4
    tok, conf = sample(logits, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {1, 2}  # 0.665 of the mass is in token 2 alone, 0.91 with token 1

    model, ps = tiny(), prompts()
    kw = dict(tau=0.5, B=4, max_new_tokens=20, temperature=1.0)
    first = decode(model, ps, MASK, set(), **kw, generator=torch.Generator().manual_seed(0))
    assert first == decode(model, ps, MASK, set(), **kw, generator=torch.Generator().manual_seed(0))
    assert first != decode(model, ps, MASK, set(), **kw, generator=torch.Generator().manual_seed(1))
    # A vanishing nucleus is the argmax with probability 1: greedy tokens, whole windows accepted.
    nucleus = decode(model, ps, MASK, set(), **{**kw, "top_p": 1e-6}, generator=torch.Generator())
    assert nucleus == decode(model, ps, MASK, set(), tau=0.0, B=4, max_new_tokens=20)


# ---- CLI ----

@pytest.fixture
def ckpt(tmp_path):
    # A tiny random model over the byte-level tokenizer (260 ids), saved as the demo would save it.
    torch.manual_seed(0)
    tok = Tokenizer.byte_level()
    config = Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    torch_dtype="float32", eos_token_id=tok.eos_id)
    model = Transformer(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40)  # confident enough to accept several tokens
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", model.eval(), tok


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
        out, forwards = decode_naive(model, p, tok.mask_id, tok.stop_ids, tau=0.5, B=4, max_new_tokens=12)
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
    main(["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "12", "--cache", "step"])
    captured = capsys.readouterr()
    p = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    out, forwards = decode_naive(model, p, tok.mask_id, tok.stop_ids, tau=0.9, B=4, max_new_tokens=12)
    assert captured.out.startswith(tok.decode([t for t in out if t not in tok.stop_ids]).rstrip("\ufffd"))
    assert f"new tokens {len(out)} | forwards {forwards} |" in captured.err and "first token" in captured.err


@pytest.mark.parametrize("args,status,message", [
    (["--threshold", "1.5"], 2, r"--threshold 1.5 is outside \[0, 1\]"),
    (["--block-size", "0"], 2, "--block-size 0 must be at least 1"),
    (["--block-cache-size", "8"], 2, "--block-cache-size 8: needs a positive size and --cache block"),
    (["--prompt", "ok", " "], 1, "--prompt 2: empty prompt; give it some text"),
    (["--max-new-tokens", "120"], 1,
     "--prompt 1: 2[0-9] tokens \\+ --max-new-tokens 120 exceed the model's context of 128"),
    (["--prompts", "missing.jsonl"], 1, "--prompts missing.jsonl: file not found"),
])
def test_cli_bad_arguments(ckpt, monkeypatch, capsys, args, status, message):
    # A bad flag is a usage error (status 2, one line on stderr); a bad prompt exits with its message (status 1).
    path, _, _ = ckpt
    monkeypatch.setattr(generate.Transformer, "from_pretrained", lambda *a, **kw: pytest.fail("loaded weights"))
    argv = ["--ckpt", str(path), "--max-new-tokens", "16"] + ([] if "--prompt" in args else ["--prompt", "hello"]) + args
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
    with pytest.raises(SystemExit, match="config.json:1: corrupted config"):
        main(["--ckpt", str(path), "--prompt", "hi"])
    (path / "config.json").unlink()
    with pytest.raises(SystemExit, match="config.json not found"):
        main(["--ckpt", str(path), "--prompt", "hi"])


def test_bench_runs(ckpt, capsys):
    from tools import bench

    path, _, _ = ckpt
    bench.main(["--ckpt", str(path), "--reps", "1", "--batch-sizes", "1", "3", "--thresholds", "0.9",
                "--max-new-tokens", "8", "--block-cache-size", "4", "--no-hf"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    methods = [line.split(" | ")[1] for line in table[1:]]
    assert methods == ["AR + KV cache", "MARS step", "AR + KV cache", "MARS block K=4", "MARS cursor"]
    assert all(line.endswith("| 8 |") or line.endswith("| 24 |") for line in table[1:])


def test_mask_and_spare_rows_are_never_candidates():
    # As in Qwen2.5: the tokenizer's ids end with the mask (60 here), the embedding has spare rows
    # after it (61..63). Make the mask row and a spare row win every argmax: neither may be emitted.
    model, mask, vocab = tiny(), 60, 61
    with torch.no_grad():
        model.model.embed_tokens.weight[[mask, 62]] *= 50
    ps = [[t % mask for t in p] for p in prompts((4, 9))]
    for cache in ("none", "cursor", "block"):
        outs, _ = decode(model, ps, mask, set(), tau=0.5, B=4, max_new_tokens=12, cache=cache, block=8,
                         vocab_size=vocab)
        assert all(len(o) == 12 and max(o) < mask for o in outs), cache
    out, _ = decode_naive(model, ps[0], mask, set(), tau=0.5, B=4, max_new_tokens=12, vocab_size=vocab)
    assert len(out) == 12 and max(out) < mask
    # Without the rule the argmax would be the mask: the test can fail.
    assert model(torch.tensor([ps[0] + [mask]]))[0, -1].argmax().item() in (mask, 62)


def test_tau_one_feeds_no_masks():
    # tau = 1 accepts one token per step, so the step is a plain AR step: no mask is ever forwarded.
    model, seen = tiny(), []
    hidden = model.hidden
    model.hidden = lambda x, *a, **k: seen.append(x) or hidden(x, *a, **k)
    for cache in ("none", "step", "cursor"):
        seen.clear()
        out, f = decode(model, prompts((6,)), MASK, set(), tau=1.0, B=4, max_new_tokens=8, cache=cache)
        assert f == [8] and all((x != MASK).all() for x in seen), cache
    seen.clear()
    decode(model, prompts((6,)), MASK, set(), tau=0.9, B=4, max_new_tokens=8, cache="step")
    assert any((x == MASK).any() for x in seen)  # and below 1 the window does carry masks


def test_calibration_scores_each_slot_against_the_answer(ckpt):
    from tools import calibrate

    _, model, tok = ckpt
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}]
    stats = calibrate.calibration(model, tok, rows, B=4)
    n = len(tok.encode("hello there")) + 2 - 4  # answer + <|im_end|>\n, minus the window
    assert {slot for slot, _ in stats} == {0, 1, 2, 3}
    assert all(sum(s[1] for (slot, _), s in stats.items() if slot == i) == n for i in range(4))
    # Slot 0 is the plain AR prediction: count its hits independently with one forward.
    prompt = tok.encode_chat(rows[0]["messages"][:1], add_generation_prompt=True)
    full = tok.encode_chat(rows[0]["messages"])
    with torch.no_grad():
        logits = calibrate.allowed(model(torch.tensor([full]))[0], tok.mask_id, tok.vocab_size)
    hits = sum(int(logits[c - 1].argmax() == full[c]) for c in range(len(prompt), len(prompt) + n))
    assert sum(s[0] for (slot, _), s in stats.items() if slot == 0) == hits
