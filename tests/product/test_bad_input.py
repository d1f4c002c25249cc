# Every bad input gets one clear line: the boundary (model.py, tokenizer.py, data.py) names the file,
# the line and the fix; each script (train.py, generate.py, serve.py) prints it as one line and exits
# with status 2 for a bad flag, 1 for a bad file. Unexpected errors keep their traceback. The scripts
# run in-process through main(argv); one subprocess test checks the real exit statuses.
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import generate
import train
from conftest import tiny_checkpoint
from mars import run, serve
from mars.tokenizer import Tokenizer
from model import Config, Transformer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    # A tiny checkpoint over the byte-level tokenizer, chat data, and a prompts file.
    root = tmp_path_factory.mktemp("bad-input")
    tiny_checkpoint(root / "ckpt")
    chat = {"messages": [{"role": "user", "content": "add 1 2"}, {"role": "assistant", "content": "3"}]}
    (root / "train.jsonl").write_text((json.dumps(chat) + "\n") * 8)
    (root / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    return root


@pytest.fixture
def broken(good, tmp_path):
    # A fresh copy of the good checkpoint to break.
    shutil.copytree(good / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def edit_config(ckpt: Path, **fields) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **fields}))


def usage_error(main, argv: list[str], capsys) -> str:
    # A bad flag: exit status 2 and one line on stderr, before any file is read.
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error: " in err, err
    return err


def data_error(main, argv: list[str]) -> str:
    # A bad file: SystemExit with the message, which Python prints on stderr with exit status 1.
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


# ---- the boundary: bad checkpoints are named where they are read ----

@pytest.mark.parametrize("fields,message", [
    ({"hidden_size": "128"}, 'hidden_size is "128", it must be a positive integer'),
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0, it must be a positive integer"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads is 3, it must be a divisor of num_attention_heads \(4\)"),
    ({"num_hidden_layers": True}, "num_hidden_layers is true, it must be a positive integer"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps .* must be a positive number"),
    ({"rope_theta": -1.0}, "rope_theta is -1.0, it must be a positive number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings .* must be true or false"),
    ({"head_dim": 7}, "head_dim is 7, it must be an even integer"),
    ({"hidden_size": 30, "head_dim": None}, "hidden_size is 30, it must be a multiple of num_attention_heads"),
    ({"eos_token_id": "eos"}, "eos_token_id .* must be a token id"),
])
def test_config_fields_are_checked(broken, fields, message):
    edit_config(broken, **fields)
    with pytest.raises(ValueError, match=f"{broken / 'config.json'}: {message}.*fix it"):
        Config.from_json(broken / "config.json")
    edit_config(broken, hidden_size=32, num_key_value_heads=2, num_hidden_layers=2, rms_norm_eps=1e-6,
                rope_theta=1e4, tie_word_embeddings=True, head_dim=8, eos_token_id=[258, 256])
    assert Config.from_json(broken / "config.json").eos_token_id == [258, 256]  # lists stay allowed


def test_unreadable_files_are_named(broken):
    config = broken / "config.json"
    config.write_bytes(b'{\n  "hidden_size": 32,\n  "name": "caf\xe9"\n}')
    with pytest.raises(ValueError, match=f"{config}:3: not UTF-8 text"):
        Config.from_json(config)
    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=f"{config}: JSON nested too deeply"):
        Config.from_json(config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        good = (broken / name).read_bytes()
        (broken / name).write_bytes(b'{"model": "\xff"}')
        with pytest.raises(ValueError, match=f"{broken / name}:1: not UTF-8 text"):
            Tokenizer.from_pretrained(broken)
        (broken / name).write_bytes(good)


def test_broken_weights_are_named(good, broken):
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    for bad in (os.urandom(4096), data[: len(data) // 2], data[:5], b""):
        weights.write_bytes(bad)
        with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file.*download or copy"):
            Transformer.from_pretrained(broken)
    weights.write_bytes(data)
    edit_config(broken, intermediate_size=48)  # config and weights disagree
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' has "
                                         r"shape \[\d+, \d+\], config.json implies \[\d+, \d+\]"):
        Transformer.from_pretrained(broken)


# ---- generate.py ----

@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "argument --temperature: nan is not a number"),
    (["--temperature", "inf"], "--temperature inf must be in [0, 100]"),
    (["--temperature", "1e300"], "--temperature 1e+300 must be in [0, 100]"),
    (["--top-p", "0.9"], "--top-p 0.9 samples: it needs --temperature above 0"),
    (["--seed", str(2**64)], f"--seed {2**64} must be in [0, 2**63)"),
    (["--draft-budget", "5"], "--draft-budget applies to --verify only; add --verify or drop it"),
    (["--verify-layout", "chain"], "--verify-layout applies to --verify only"),
    (["--verify", "--verify-layout", "chain", "--draft-budget", "5"], "--draft-budget 5 sizes the tree layout"),
    (["--threshold", "nan"], "argument --threshold: nan is not a number"),
    (["--device", "tpu"], "--device tpu: choose auto, cpu, cuda or cuda:N"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (["--cache", "fast"], "argument --cache: invalid choice: 'fast'"),
    (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
])
def test_generate_bad_flags(good, flags, message, capsys):
    err = usage_error(generate.main, ["--ckpt", str(good / "ckpt"), "--prompt", "hi", *flags], capsys)
    assert message in err and err.endswith("(see --help)\n")


def test_generate_bad_files(good, broken, tmp_path, capsys):
    run = lambda *extra: data_error(generate.main, ["--ckpt", str(broken), "--max-new-tokens", "4", *extra])  # noqa: E731
    edit_config(broken, hidden_size="128")
    assert f"{broken / 'config.json'}: hidden_size is \"128\"" in run("--prompt", "hi")
    edit_config(broken, hidden_size=32, num_key_value_heads=0)
    assert "num_key_value_heads is 0" in run("--prompt", "hi")
    edit_config(broken, num_key_value_heads=2, intermediate_size=48)
    assert "model.safetensors: tensor 'model.layers.0.mlp." in run("--prompt", "hi")
    edit_config(broken, intermediate_size=64)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    for bad in (os.urandom(4096), data[: len(data) - 100]):
        weights.write_bytes(bad)
        assert f"{weights}: not a readable safetensors file" in run("--prompt", "hi")
    weights.write_bytes(data)
    (broken / "config.json").write_bytes((broken / "config.json").read_bytes().replace(b'"qwen2"', b'"q\xe9"'))
    assert f"{broken / 'config.json'}:" in run("--prompt", "hi") and "not UTF-8" in run("--prompt", "hi")
    shutil.copy(good / "ckpt" / "config.json", broken / "config.json")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    assert f"{prompts}:2: not UTF-8 text (byte 0xe9)" in run("--prompts", str(prompts))
    prompts.write_text('{"prompt": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    assert f"{prompts}:2: JSON nested too deeply" in run("--prompts", str(prompts))
    nested = json.loads('{"a": ' * 900 + "1" + "}" * 900)
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": nested}]}))
    assert f"{prompts}:1: messages[0]" in run("--prompts", str(prompts))
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
    assert f"{prompts}:1: messages[0].content[0] is a 'image_url' part; only text is taken" in run("--prompts",
                                                                                                    str(prompts))
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}))
    assert f"{prompts}:1: messages[0].content[0] is a text part without a string \"text\"" in run("--prompts",
                                                                                                    str(prompts))
    assert f"--prompts {tmp_path}: a folder; pass a JSONL file of prompts" in run("--prompts", str(tmp_path))
    # The checkpoint is fine again: the same command decodes.
    generate.main(["--ckpt", str(broken), "--max-new-tokens", "4", "--prompt", "hi", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]["prompts"] == 1


def test_generate_reads_prompts_as_openai_clients_write_them_and_from_a_pipe(good, tmp_path, capsys):
    # Content as a list of text parts and the developer role (newer OpenAI clients) are what a string and the
    # system role are; the file may be a pipe (bash's <(...)).
    import threading

    plain = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 1\n2"}]}
    text = [{"type": "text", "text": "add 1"}, {"type": "text", "text": "2"}]
    parts = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": text}]}
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text(json.dumps(plain) + "\n" + json.dumps(parts) + "\n"))
    writer.start()
    generate.main(["--ckpt", str(good / "ckpt"), "--max-new-tokens", "4", "--prompts", str(pipe), "--json"])
    writer.join()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()[:2]]
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"] and rows[0]["output_ids"] == rows[1]["output_ids"]


def test_generate_raw_rows_odd_bytes_and_a_narrow_stdout(good, tmp_path, capsys, monkeypatch):
    # --raw continues a row's "prompt" text; a row whose messages won (its "prompt" not text) stays a chat.
    ckpt = ["--ckpt", str(good / "ckpt"), "--max-new-tokens", "4", "--threshold", "1"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({**chat, "prompt": None}) + "\n" + json.dumps(chat) + "\n")
    generate.main([*ckpt, "--prompts", str(rows), "--raw", "--json"])
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines()[:2])
    assert first["prompt_ids"] == second["prompt_ids"] and first["output_ids"] == second["output_ids"]
    # Bytes that are not UTF-8 in --prompt (Python hands them over as surrogates) are refused, not replaced.
    with pytest.raises(SystemExit, match=r"--prompt 2: a byte that is not UTF-8 \(0xff\); give the prompt in UTF-8"):
        generate.main([*ckpt, "--prompt", "ok", os.fsdecode(b"\xff\xfe")])
    # A stdout whose encoding lacks a reply's characters (a Latin-1 locale) prints them as "?", not a traceback.
    generate.main([*ckpt, "--prompt", "日本", "--json"])
    tok = Tokenizer.byte_level()
    reply = tok.decode([t for t in json.loads(capsys.readouterr().out.splitlines()[0])["output_ids"]
                        if t not in tok.stop_ids])
    assert reply.encode("latin-1", errors="replace") != reply.encode("latin-1", errors="ignore")  # one it lacks
    narrow = io.TextIOWrapper(io.BytesIO(), encoding="latin-1")
    monkeypatch.setattr(sys, "stdout", narrow)
    generate.main([*ckpt, "--prompt", "日本"])
    narrow.flush()
    assert narrow.buffer.getvalue() == reply.encode("latin-1", errors="replace") + b"\n"


def test_unexpected_errors_keep_their_traceback(good, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("a bug, not a bad input")

    monkeypatch.setattr(generate, "decode", bug)
    with pytest.raises(KeyError, match="a bug"):
        generate.main(["--ckpt", str(good / "ckpt"), "--prompt", "hi", "--max-new-tokens", "4"])
    monkeypatch.setattr(run, "load_examples", bug)
    with pytest.raises(KeyError, match="a bug"):
        train.main(["--init", str(good / "ckpt"), "--data", str(good / "train.jsonl"), "--out",
                    str(good / "bug-run"), "--device", "cpu"])


# ---- train.py ----

@pytest.mark.parametrize("flags,message", [
    (["--block-size", "0"], "--block-size 0 must be at least 1"),
    (["--block-size", "-4"], "--block-size -4 must be at least 1"),
    (["--block-size", "64"], "--block-size 64: at most 32, the most the decoding scripts take"),
    (["--batch-size", "3", "--global-batch", "8"], "--global-batch 8 is not a multiple of --batch-size 3 x 1 "
                                                   "processes = 3; use --batch-size 2 or 1"),
    (["--max-len", "0"], "--max-len 0 is shorter than one block (--block-size 4)"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--global-batch", "0"], "--global-batch 0 must be at least 1"),
    (["--device", "tpu"], "--device tpu: choose auto, cpu, cuda or cuda:N"),
    (["--epochs", "0"], "--epochs 0 with --max-steps 0 trains nothing"),
    (["--max-steps", "-1"], "--max-steps -1 must be at least 0"),
    (["--minutes", "-5"], "--minutes -5.0 must be a number >= 0"),
    (["--minutes", "inf"], "--minutes inf must be a number >= 0"),
    (["--lr", "nan"], "argument --lr: nan is not a number"),
    (["--lr", "-2"], "--lr -2.0 must be >= 0 (or -1 for the default)"),
    (["--warmup", "1.5"], "--warmup 1.5 must be in [0, 1)"),
    (["--grad-clip", "0"], "--grad-clip 0.0 must be > 0"),
    (["--mode", "ar", "--mask-target", "self"], "--mask-target self sets the noisy stream's targets: it needs"),
    (["--adapter", "gated-lora"], "--init tiny is built in memory: its adapter could never be loaded again"),
    (["--adapter", "gated-lora", "--compile"], "--compile with --adapter is not supported: the adapter's hooks differ"),
    (["--init", "{good}", "--out", "{good}"], "--init and --out are both {good}: a run starts from --init and saves "
                                              "to --out, which would overwrite it; give the new run"),
])
def test_train_bad_flags(good, tmp_path, flags, message, capsys):
    argv = ["--data", str(good / "train.jsonl"), "--out", str(tmp_path / "run"), *flags]
    argv = [a.format(good=good / "ckpt") for a in argv]  # the last --out wins
    assert message.format(good=good / "ckpt") in usage_error(train.main, argv, capsys)
    assert not (tmp_path / "run").exists()  # nothing was started, nothing saved


def test_train_init_and_out_the_same_folder_is_not_told_by_name(good, tmp_path, monkeypatch, capsys):
    # The same folder by another path (relative, or through a link) is refused; --init tiny is built in memory,
    # so a folder named tiny under the working directory may be its --out, to start or to resume.
    from mars.train_settings import parse_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(good / "ckpt")
    err = usage_error(parse_settings, ["--init", str(good / "ckpt"), "--data", "d.jsonl", "--out", "link"], capsys)
    assert "--init and --out are both link" in err
    (tmp_path / "tiny").mkdir()
    for resume in ([], ["--resume"]):
        assert parse_settings(["--out", "tiny", *resume]).out == "tiny"


def test_train_out_that_is_a_file(good, tmp_path, capsys):
    # Refused as a flag, before the model and the data load (the data named here does not exist).
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    err = usage_error(train.main, ["--data", str(tmp_path / "missing.jsonl"), "--out", str(out)], capsys)
    assert f"--out {out} is a file" in err and "choose another --out" in err
    assert out.read_text() == "keep me"
    # Under a file, where no folder can be made: one line naming --out, no traceback.
    message = data_error(train.main, ["--data", str(good / "train.jsonl"), "--out", str(out / "run")])
    assert message == f"error: --out {out / 'run'}: cannot write there (Not a directory: {out / 'run'}); choose " \
                      "another --out"


def test_train_bad_data(good, tmp_path):
    def run(data: str, *extra) -> str:
        return data_error(train.main, ["--data", data, "--out", str(tmp_path / "run"), "--device", "cpu",
                                       "--batch-size", "2", "--global-batch", "2", "--max-steps", "1", *extra])

    missing = tmp_path / "missing.jsonl"
    assert f"--data {missing}: no such file" in run(str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text((good / "train.jsonl").read_text() + '{"messages": [\n')
    assert f"{bad}:9: not valid JSON" in run(str(bad))
    bad.write_bytes((good / "train.jsonl").read_bytes() + b'{"messages": "caf\xe9"}\n')
    assert f"{bad}:9: not UTF-8 text (byte 0xe9)" in run(str(bad))
    bad.write_text('{"question": "2+2?", "answer": "4"}\n')
    assert f"{bad}:1: no 'messages' (chat)" in run(str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}))
    assert f"{bad}:1: messages[1] has role 'bot'" in run(str(bad))
    bad.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert f"{bad}:1: JSON nested too deeply" in run(str(bad))
    empty = tmp_path / "folder"
    empty.mkdir()
    (empty / "notes.txt").write_text("no data here")
    assert f"--data {empty}: the folder holds no .jsonl, .json or .parquet file" in run(str(empty))
    # Rows that all drop: named with why, not "lower --global-batch".
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    message = run(str(bad))
    assert f"--data {bad}: no example to train on. data: 1 examples, 0 kept" in message
    assert "1 dropped (no reply to train on)" in message and "lower --global-batch" not in message
    # A JSON array that starts with a UTF-8 byte order mark trains as the same file without one.
    array = tmp_path / "array.json"
    rows = [json.loads(line) for line in (good / "train.jsonl").read_text().splitlines()]
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    train.main(["--data", str(array), "--out", str(tmp_path / "bom"), "--device", "cpu", "--batch-size", "2",
                "--global-batch", "2", "--max-steps", "1", "--eval-every", "0", "--quiet"])
    assert (tmp_path / "bom" / "model.safetensors").exists()
    # A missing --eval-data is named as --eval-data, not as --data.
    message = run(str(good / "train.jsonl"), "--eval-data", str(missing))
    assert f"--eval-data {missing}: no such file" in message and "--data" not in message.replace("--eval-data", "")
    # JSON Lines in a .json file (datasets' to_json writes them) trains, a first row longer than 4 KB too.
    lines = tmp_path / "lines.json"
    long = {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]}
    lines.write_text(json.dumps(long) + "\n" + (good / "train.jsonl").read_text())
    train.main(["--data", str(lines), "--out", str(tmp_path / "lines"), "--device", "cpu", "--batch-size", "2",
                "--global-batch", "2", "--max-steps", "1", "--eval-every", "0", "--quiet"])
    # A pretty-printed .json object is neither an array nor JSON Lines: said so, with the fix.
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(rows[0], indent=2))
    assert f"{pretty}: a .json file holds one JSON array of chat rows" in run(str(pretty))
    assert "wrap the rows in [ ] or write each on one line" in run(str(pretty))
    # A folder's data files are files: a folder named like one is left out.
    shutil.copy(good / "train.jsonl", empty / "train.jsonl")
    (empty / "more.jsonl").mkdir()
    train.main(["--data", str(empty), "--out", str(tmp_path / "folder-run"), "--device", "cpu", "--batch-size", "2",
                "--global-batch", "2", "--max-steps", "1", "--eval-every", "0", "--quiet"])
    # A data file's path with a typo is not a hub id, whatever its first folder.
    assert "--data dta/train.jsonl: no such file or folder" in run("dta/train.jsonl")
    assert not (tmp_path / "run").exists()  # each failed run removed its lock and the --out it made


def test_train_finds_a_missing_data_path_before_the_model_loads(good, tmp_path, monkeypatch):
    # A typo in --data or --eval-data costs no load (or download) of --init: said before build_model runs.
    from mars import checkpoint

    monkeypatch.setattr(checkpoint, "build_model", lambda *a: pytest.fail("the model loaded first"))
    for flags, named in ((["--data", "dta/train.jsonl"], "--data dta/train.jsonl"),
                         (["--data", str(good / "train.jsonl"), "--eval-data", "evl.jsonl"], "--eval-data evl.jsonl")):
        message = data_error(train.main, ["--init", str(good / "ckpt"), *flags, "--out", str(tmp_path / "run"),
                                          "--device", "cpu"])
        assert message.startswith(f"error: {named}: no such file or folder")


def test_train_without_data_on_a_fresh_clone_says_make_demo(good, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/demo here
    message = data_error(train.main, ["--out", str(tmp_path / "run"), "--device", "cpu", "--max-steps", "1"])
    assert message == ("error: --data data/demo/train.jsonl (--init tiny's default) is not here: `make demo` writes "
                       "it (run from the repository's folder), or pass --data")


def test_train_never_writes_over_a_model_it_did_not_train(good, tmp_path):
    # --out at a model folder without a run's metrics.jsonl (--init's own is a usage error, test_train_bad_flags):
    # refused before anything is written.
    model = tmp_path / "model"
    shutil.copytree(good / "ckpt", model)
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    argv = ["--init", str(good / "ckpt"), "--data", str(good / "train.jsonl"), "--out", str(model), "--device", "cpu",
            "--batch-size", "2", "--global-batch", "2", "--max-steps", "1"]
    message = data_error(train.main, argv)
    assert message == (f"error: {model} holds a model (config.json) and no run of this code: the run's saves would "
                       "overwrite it (a base given as --init, say); choose another --out")
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before


def test_train_bad_init(good, broken, tmp_path):
    run = lambda: data_error(train.main, ["--init", str(broken), "--data", str(good / "train.jsonl"), "--out",  # noqa: E731
                                          str(tmp_path / "run"), "--device", "cpu"])
    (broken / "config.json").write_text('{"hidden_size": 32,')
    assert f"{broken / 'config.json'}:1: not valid JSON" in run()
    shutil.copy(good / "ckpt" / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(os.urandom(2048))
    assert f"{broken / 'model.safetensors'}: not a readable safetensors file" in run()
    (broken / "model.safetensors").unlink()
    assert f"{broken}: no model.safetensors" in run()


def test_train_examples_past_the_models_context(good, tmp_path):
    # The model's max_position_embeddings bounds the examples, not --max-len: a long --max-len on short data
    # trains; one that lets an example past the context is refused, before anything is written.
    context = json.loads((good / "ckpt" / "config.json").read_text())["max_position_embeddings"]
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y" * (2 * context)}]
    data = tmp_path / "long.jsonl"
    data.write_text((good / "train.jsonl").read_text() + json.dumps({"messages": chat}) + "\n")
    argv = ["--init", str(good / "ckpt"), "--out", str(tmp_path / "run"), "--device", "cpu", "--batch-size", "2",
            "--global-batch", "2", "--max-steps", "1", "--eval-every", "0", "--max-len", str(context + 8)]
    err = data_error(train.main, ["--data", str(data), *argv])
    assert err == (f"error: --data {data}: examples of up to {context + 8} tokens (--max-len {context + 8}), past "
                   f"the model's context, max_position_embeddings {context}, where generate.py and serve.py stop: "
                   f"lower --max-len to {context}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    train.main(["--data", str(good / "train.jsonl"), *argv])  # the same flags, short data
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_resume_with_nothing_left_to_do(good, tmp_path):
    # A resumed run whose checkpoint already reached --max-steps would train 0 steps and save the
    # checkpoint again as if trained: refused.
    argv = ["--init", str(good / "ckpt"), "--data", str(good / "train.jsonl"), "--out", str(tmp_path / "run"),
            "--device", "cpu", "--batch-size", "2", "--global-batch", "2", "--eval-every", "0", "--save-every", "1"]
    train.main([*argv, "--max-steps", "2"])
    message = data_error(train.main, [*argv, "--max-steps", "1", "--resume"])
    assert "step-000002: the run already reached step 2, past the 1 these flags give; raise --max-steps or --epochs" \
        in message
    message = data_error(train.main, [*argv, "--max-steps", "2", "--resume"])  # a finished run: its last checkpoint
    assert "step-000002: the run already reached step 2 of 2; raise --max-steps or --epochs" in message


def test_train_errors_about_the_run_say_error(good, tmp_path, capsys):
    # The run's own refusals are printed like every other bad input: one line that starts with "error: ".
    assert "--init qwen2.5-0.5b needs --data" in usage_error(train.main, ["--init", "qwen2.5-0.5b"], capsys)
    argv = ["--data", str(good / "train.jsonl"), "--out", str(tmp_path / "run"), "--device", "cpu", "--batch-size",
            "2", "--global-batch", "2", "--max-steps", "1", "--eval-every", "0", "--save-every", "0", "--quiet"]
    train.main(argv)
    assert f"{tmp_path / 'run'} already holds a run (metrics.jsonl): pass --resume" in data_error(train.main, argv)
    assert "holds a finished model and no step checkpoint" in data_error(train.main, [*argv, "--resume"])


# ---- eval.py ----

def test_eval_demo_without_its_data_says_how_to_make_it(good, tmp_path, monkeypatch):
    # --task demo reads data/demo/test.jsonl unless --data says otherwise: missing, the file is named with
    # the commands that write it, not a raw "[Errno 2]".
    from mars import eval as evaluation

    monkeypatch.chdir(tmp_path)
    message = data_error(evaluation.main, ["--ckpt", str(good / "ckpt"), "--task", "demo"])
    assert message == ("error: --task demo: data/demo/test.jsonl (the default --data) not found; `make demo` writes "
                       "data/demo/test.jsonl, `make quickstart` writes data/quickstart/test.jsonl (pass it as "
                       "--data), or pass --data with a test file of mars/tasks.py")
    missing = tmp_path / "data" / "quickstart" / "test.jsonl"
    message = data_error(evaluation.main, ["--ckpt", str(good / "ckpt"), "--task", "demo", "--data", str(missing)])
    assert message.startswith(f"error: --data {missing} not found; `make demo` writes data/demo/test.jsonl")


# ---- serve.py ----

@pytest.mark.parametrize("flags,message", [
    (["--timeout", "0"], "--timeout 0.0 must be a number of seconds > 0"),
    (["--max-connections", "0"], "--max-connections 0 must be at least 1"),
    (["--tau-min", "nan"], "argument --tau-min: nan is not a number"),
    (["--port", "70000"], "--port 70000 in 0..65535"),
    (["--drain-seconds", "-1"], "--drain-seconds -1.0 must be a number of seconds >= 0"),
    (["--block-size", "1000"], "--block-size 1000 must be in 1..32 (or 0: the checkpoint's own)"),
])
def test_serve_bad_flags(good, flags, message, capsys):
    assert message in usage_error(serve.main, ["--ckpt", str(good / "ckpt"), *flags], capsys)


def test_serve_bad_weights(broken):
    (broken / "model.safetensors").write_bytes(os.urandom(4096))
    message = data_error(serve.main, ["--ckpt", str(broken), "--port", "0"])
    assert f"{broken / 'model.safetensors'}: not a readable safetensors file" in message


def test_serve_ctrl_c_before_serving_is_one_line(good, monkeypatch, capsys):
    monkeypatch.setattr(serve, "launch", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as e:
        serve.main(["--ckpt", str(good / "ckpt")])
    assert e.value.code == 130 and capsys.readouterr().err == "\ninterrupted before serving\n"


def test_serve_a_cache_that_cannot_fit_is_said_before_the_budget_is_measured(good, monkeypatch):
    # The tiny model's cache: 2 layers x 2 kv heads x 8 dims x 2 (k, v) x 4 bytes = 256 bytes a position.
    monkeypatch.setattr(serve, "free_bytes", lambda device: 2**29)
    monkeypatch.setattr(serve, "measured_policy", lambda *a: pytest.fail("measured first"))
    message = data_error(serve.main, ["--ckpt", str(good / "ckpt"), "--port", "0", "--max-rows", "8192",
                                      "--max-len", "256"])
    assert message == ("error: the KV cache of --max-rows 8192 rows, 528 positions each (twice --max-len 256, and a "
                       "verify step's room), needs 1.0 GiB and cpu has 0.5 GiB free: lower --max-rows or --max-len")


def test_a_checkpoint_trained_past_the_block_size_cap_is_one_line(broken, tmp_path):
    (broken / "settings.json").write_text(json.dumps({"block_size": 64}))
    message = data_error(generate.main, ["--ckpt", str(broken), "--prompt", "hi"])
    assert message.endswith("trained with block size 64 (its settings.json), more than the 32 the decoding scripts "
                            "take; pass --block-size 32 or less")
    generate.main(["--ckpt", str(broken), "--prompt", "hi", "--block-size", "4", "--max-new-tokens", "2"])


def test_the_free_memory_a_cache_may_take_is_a_containers_limit_where_one_is_set(tmp_path):
    import torch

    cpu = torch.device("cpu")
    assert serve.free_bytes(cpu, tmp_path) > 0  # no cgroup files: the machine's MemAvailable
    (tmp_path / "memory.max").write_text("3000000\n")
    (tmp_path / "memory.current").write_text("1000000\n")
    assert serve.free_bytes(cpu, tmp_path) == 2_000_000
    (tmp_path / "memory.stat").write_text("anon 900000\ninactive_file 500000\n")  # page cache is reclaimable
    assert serve.free_bytes(cpu, tmp_path) == 2_500_000
    (tmp_path / "memory.current").write_text("4000000\n")  # over the limit a moment: none free, not less
    assert serve.free_bytes(cpu, tmp_path) == 0
    (tmp_path / "memory.max").write_text("max\n")  # no limit
    assert serve.free_bytes(cpu, tmp_path) > 2_000_000


def test_a_served_model_is_named_as_vllm_names_it(good, tmp_path):
    # A local checkpoint by its folder's name; a hub id or alias as given, the name clients send.
    assert serve.served_name(str(good / "ckpt")) == "ckpt"
    assert serve.served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_serve_a_busy_port_or_a_wrong_host_is_said_before_the_model_loads(good, monkeypatch):
    # The fix is named by which half of host:port is wrong, and nothing loads first.
    import socket

    monkeypatch.setattr(serve, "load_model", lambda *a, **kw: pytest.fail("loaded the model first"))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        message = data_error(serve.main, ["--ckpt", str(good / "ckpt"), "--port", str(port)])
    assert message.startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and message.endswith("pick another --port")
    message = data_error(serve.main, ["--ckpt", str(good / "ckpt"), "--host", "10.255.255.1", "--port", "8123"])
    assert "cannot listen on 10.255.255.1:8123: " in message and message.endswith(
        "check --host: a name or address of this machine (127.0.0.1, or 0.0.0.0 for every interface)")


def test_real_exit_statuses(good, broken):
    # The same checks outside pytest: status 2 and one line for a flag, status 1 and one line for a file.
    (broken / "model.safetensors").write_bytes(os.urandom(4096))
    for argv, status, message in [(["--ckpt", str(good / "ckpt"), "--prompt", "hi", "--temperature", "nan"], 2,
                                    "generate.py: error: argument --temperature: nan is not a number"),
                                   (["--ckpt", str(broken), "--prompt", "hi"], 1,
                                    f"error: {broken / 'model.safetensors'}: not a readable safetensors file")]:
        proc = subprocess.run([sys.executable, str(ROOT / "generate.py"), *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == status and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_generate_ctrl_c_and_a_closed_pipe_end_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setattr(generate, "run", lambda argv: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as e:
        generate.main([])
    assert e.value.code == 130 and capsys.readouterr().err == "\ninterrupted\n"
    # | head: the reader closes the pipe while the replies still stream
    script = ("import generate, itertools\n"
              "generate.run = lambda argv: [print('x' * 100, flush=True) for _ in itertools.count()]\n"
              "generate.main([])\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(3) == b"xxx"
    proc.stdout.close()
    assert proc.wait(timeout=60) == 1 and proc.stderr.read() == b""


def test_train_init_with_a_dtype_it_does_not_know(good, broken, tmp_path):
    # transformers writes "torch_dtype": "auto" at times: the model loads as float32 and saves as float32.
    edit_config(broken, torch_dtype="auto")
    train.main(["--init", str(broken), "--data", str(good / "train.jsonl"), "--out", str(tmp_path / "run"),
                "--device", "cpu", "--batch-size", "2", "--global-batch", "2", "--max-steps", "1", "--eval-every",
                "0", "--quiet"])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["torch_dtype"] == "float32"
