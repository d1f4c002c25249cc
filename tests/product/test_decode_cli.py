# What a user runs around generate.py's rule: the checkpoint's own block size B in every entry point,
# the streamed reply (mars/prompts.py) and the speed benchmark (tools/bench.py). The rule itself is
# tests/spec/test_generate.py's.
import json

import pytest
import torch

import generate
from conftest import tiny_checkpoint
from generate import main
from mars.tokenizer import Tokenizer


@pytest.fixture
def ckpt(tmp_path):
    model, tok = tiny_checkpoint(tmp_path / "ckpt", spread=0, sharpen=40,  # confident: several tokens per step
                                 max_position_embeddings=128)
    return tmp_path / "ckpt", model, tok


def test_block_size_defaults_to_the_checkpoints_own(ckpt, capsys, monkeypatch, tmp_path):
    # train.py writes block_size into settings.json; every entry point decodes with it unless told otherwise.
    from mars import eval as ev
    from mars import serve
    from tools import lm_eval_mars

    path, model, tok = ckpt
    seen = []
    real = generate.decode
    monkeypatch.setattr(generate, "decode", lambda *a, **kw: seen.append(a[4].B) or real(*a, **kw))
    main(["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "4", "--json", "--threshold", "1"])
    (path / "settings.json").write_text(json.dumps({"mode": "mars", "block_size": 8}))
    capsys.readouterr()
    main(["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "4", "--json"])
    assert "not MARS-trained" not in capsys.readouterr().err
    main(["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "4", "--json", "--block-size", "2"])
    assert seen == [4, 8, 2]  # no settings.json: 4; the checkpoint's 8; a flag wins
    assert "block size 2 differs from the 8 that" in capsys.readouterr().err
    # eval.py, serve.py and the lm-eval model resolve it the same way
    data = tmp_path / "demo.jsonl"
    row = {"family": "arithmetic", "answer": "2", "messages": [{"role": "user", "content": "1+1"}]}
    data.write_text(json.dumps(row) + "\n")
    ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "0.9", "--max-new-tokens", "4",
             "--out", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["settings"]["block_size"] == 8
    server = serve.launch(serve.Settings(ckpt=str(path), port=0, quiet=True))
    try:
        assert server.engine.s.block_size == 8
    finally:
        server.close()
    pytest.importorskip("lm_eval")
    assert lm_eval_mars.MarsLM(ckpt=str(path), device="cpu", dtype="float32").settings.block_size == 8


def test_bench_runs(ckpt, capsys):
    from tools import bench

    path, _, _ = ckpt
    bench.main(["--ckpt", str(path), "--reps", "1", "--batch-sizes", "1", "3", "--thresholds", "0.9",
                "--max-new-tokens", "8", "--block-cache-size", "4", "--no-hf"])
    speed, cost = capsys.readouterr().out.split("\n\n")
    table = [line for line in speed.splitlines() if line.startswith("| ")]
    methods = [line.split(" | ")[1] for line in table[1:]]
    verify = ["MARS verify tree", "MARS verify chain"]
    assert methods == ["AR + KV cache", "MARS cursor", *verify,
                       "AR + KV cache", "MARS block K=4", "MARS cursor", *verify]
    assert all(line.endswith("| 8 |") or line.endswith("| 24 |") for line in table[1:])
    # The cost of a forward: AR feeds one position per row; a verify tree feeds more than a chain.
    cost = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in cost.splitlines()[2:]}
    assert float(cost["| 1", "AR + KV cache"][4]) == 1.0 and cost["| 1", "AR + KV cache"][6] == "1.00x |"
    assert float(cost["| 3", "MARS verify tree"][4]) > float(cost["| 3", "MARS verify chain"][4]) > 1


def test_the_streamer_prints_a_held_back_character_at_the_end(capsys):
    # A step's text that ends inside a UTF-8 character waits for the next step; when none comes, the final
    # call prints it, so what streams is the whole reply.
    from mars.prompts import streamer

    show = streamer(Tokenizer.byte_level())
    show(0, list(b"Hello"))
    show(0, list(b" wor") + [0xC3])
    assert capsys.readouterr().out == "Hello"
    show(0, [], final=True)
    assert capsys.readouterr().out == " wor\ufffd\n"  # and ends the reply's line: stdout piped to a file ends in one
    show = streamer(Tokenizer.byte_level())
    show(0, list(b"caf") + [0xC3])
    show(0, [0xA9])  # the next step completes it
    assert capsys.readouterr().out == "caf\u00e9"


def test_a_model_with_no_row_for_the_mask_decodes_ar_and_refuses_masks_by_name(tmp_path, capsys):
    # A fine-tune resized to its tokenizer's ids has no embedding row for <|mask|>: AR decodes it as greedy
    # does; a rule that would feed masks stops before loading, with one line naming the fix, in every entry point.
    from mars import eval as ev
    from mars import serve

    path = tmp_path / "small"
    model, tok = tiny_checkpoint(path, vocab_size=259, max_position_embeddings=512)  # the mask id is 259
    main(["--ckpt", str(path), "--prompt", "hi", "--max-new-tokens", "6", "--json", "--threshold", "1"])
    got = json.loads(capsys.readouterr().out.splitlines()[0])["output_ids"]
    ids = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    want = []
    for _ in range(6):  # greedy, by hand, over the model's real tokens
        want.append(int(model(torch.tensor([ids + want]))[0, -1, :tok.vocab_size].argmax()))
        if want[-1] in tok.stop_ids:
            break
    assert got == want
    message = r"small: the mask id 259 has no embedding row \(vocab_size 259 in its config.json\), and {} feeds"
    for flags, why in ((["--verify"], "--verify"), (["--threshold", "0.5"], "--threshold 0.5")):
        with pytest.raises(SystemExit, match=message.format(why)):
            main(["--ckpt", str(path), "--prompt", "hi", *flags])
    data = tmp_path / "demo.jsonl"
    data.write_text(json.dumps({"family": "arithmetic", "answer": "2",
                                "messages": [{"role": "user", "content": "1+1"}]}) + "\n")
    with pytest.raises(SystemExit, match=message.format("--modes verify 0.9")):
        ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "verify", "1", "0.9"])
    ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "1", "--max-new-tokens", "2"])
    why = r"serve.py \(a request may self-verify or take a threshold below 1\)"
    with pytest.raises(ValueError, match=message.format(why)):
        serve.launch(serve.Settings(ckpt=str(path), port=0, quiet=True))
    lm_eval = pytest.importorskip("tools.lm_eval_mars")
    lm = lm_eval.MarsLM(ckpt=str(path), device="cpu", dtype="float32")  # scoring feeds no mask: it loads
    with pytest.raises(ValueError, match=message.format("threshold=0.9") + r".*\(threshold=1.0 in --model_args\)"):
        lm.generate_until([])


@pytest.mark.parametrize("flags", [["--threshold", "0.5"], ["--verify", "--draft-budget", "3"]])
def test_a_sampled_prompts_text_follows_seed_not_batch_size(tmp_path, capsys, flags):
    path = tmp_path / "ckpt"
    tiny_checkpoint(path, seed=1, max_position_embeddings=128)  # unsure: each draw can go either way
    run = ["--ckpt", str(path), "--prompt", "one", "two", "three", "--json", "--temperature", "1.2",
           "--max-new-tokens", "10", *flags]

    def outputs(*more):
        main([*run, *more])
        return [json.loads(line)["output_ids"] for line in capsys.readouterr().out.splitlines()[:3]]

    together = outputs("--batch-size", "3")
    assert outputs("--batch-size", "1") == together == outputs("--batch-size", "2")
    assert outputs("--batch-size", "3", "--seed", "1") != together


def test_a_compiled_runs_report_says_its_times_include_compiling(capsys):
    from mars import prompts
    from mars.layout import Stats

    tok = Tokenizer.byte_level()
    for compile in (False, True):
        s = prompts.Settings(prompt=["hi"], compile=compile)
        prompts.report(s, tok, [[1, 2]], [[104, 105]], [2], Stats([0], [0], [0], [0]), 0.5, 0.1)
        err = capsys.readouterr().err
        assert ("include compiling" in err) == compile
        prompts.report(prompts.Settings(prompt=["hi"], compile=compile, json=True), tok, [[1, 2]], [[104, 105]], [2],
                       Stats([0], [0], [0], [0]), 0.5, 0.1)
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
        assert summary.get("includes_compiling", False) == compile


def test_a_raw_prompt_is_the_models_input_as_it_is_whitespace_too(ckpt, capsys):
    path, _, tok = ckpt
    from mars.prompts import encode_prompts
    assert encode_prompts(["\n    "], "", True, tok, 4, 128) == [tok.encode("\n    ")]
    main(["--ckpt", str(path), "--raw", "--prompt", "\n", "--max-new-tokens", "3", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[0])["prompt_ids"] == tok.encode("\n")
