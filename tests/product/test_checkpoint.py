# What a saved MARS checkpoint carries for other tools: transformers (AutoModelForCausalLM,
# AutoTokenizer, apply_chat_template, GenerationConfig) must reproduce our logits and prompt ids, and
# config.json names the mask id as pard_token, where vLLM's parallel drafting reads it. vLLM itself
# is not installed here; these are the files it reads.
import errno
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import train
from conftest import tiny_model
from mars import checkpoint
from mars.tokenizer import Tokenizer
from model import Transformer

CHATS = [[{"role": "user", "content": "What is 12 + 7?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]]


def saved(tmp_path, mode: str):
    # A tiny model saved by the checkpoint writer train.py uses, as a run in `mode` leaves it.
    # Spread weights: biases away from 0 and norms away from 1, so a dropped one shows.
    tok = Tokenizer.byte_level()
    model = tiny_model(0, sharpen=1.0, vocab_size=tok.vocab_size + 4, bos_token_id=tok.pad_id,
                       eos_token_id=tok.eos_id)
    out = tmp_path / mode
    checkpoint.save_checkpoint(out, model, tok, asdict(replace(train.Settings(), mode=mode)), model.state_dict(),
                               torch.float32)
    return out, model, tok


@pytest.fixture(scope="module")
def mars(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("ckpt"), "mars")


def test_config_has_what_vllm_reads(mars):
    path, model, tok = mars
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["torch_dtype"] == "float32"
    assert config["pard_token"] == tok.mask_id == 259  # the MARS mask: vLLM's parallel-drafting token
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_id, tok.pad_id] and generation["do_sample"] is False
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] and tokenizer_config["mask_token"] == "<|mask|>"
    assert (path / "tokenizer.json").is_file()


def test_what_vllm_parallel_drafting_reads(mars):
    # vLLM's parallel drafting (method draft_model) takes the drafter's mask id from its config.json,
    # mask_token_id when set, else pard_token, and feeds it after the last token: it must be the id of the
    # tokenizer's own mask, which the tokenizer files name, and a row of the embedding. make vllm-check
    # runs vLLM on such a checkpoint (results/vllm.json).
    path, _, tok = mars
    config = json.loads((path / "config.json").read_text())
    mask = config.get("mask_token_id", config["pard_token"])
    assert mask == config["pard_token"] == tok.mask_id < config["vocab_size"]
    added = {t["content"]: t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
    assert added[tok.mask_token] == mask
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["mask_token"] == tok.mask_token == "<|mask|>"
    assert tokenizer_config["added_tokens_decoder"][str(mask)]["content"] == tok.mask_token
    assert Tokenizer.from_pretrained(path).mask_id == mask  # and it reads back as the same mask


def test_ar_checkpoint_names_no_drafting_token(tmp_path):
    # An AR SFT model's mask row is untrained: it is no drafter, and its config does not say it is one.
    path, _, _ = saved(tmp_path, "ar")
    assert "pard_token" not in json.loads((path / "config.json").read_text())


def test_transformers_reproduces_logits_and_prompt_ids(mars):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path, model, tok = mars
    assert AutoConfig.from_pretrained(path).pard_token == tok.mask_id  # kept, and harmless
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = AutoTokenizer.from_pretrained(path)
    assert ref.mask_token_id == tok.mask_id and ref.eos_token_id == tok.eos_id
    assert GenerationConfig.from_pretrained(path).eos_token_id == [tok.eos_id, tok.pad_id]
    for messages in CHATS:
        ids = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == tok.encode_chat(messages, add_generation_prompt=True)
        x = torch.tensor([ids + [tok.mask_id] * 4])  # the MARS window: the masks are ordinary tokens to it
        with torch.no_grad():
            assert torch.allclose(hf(x).logits, model(x), atol=1e-5, rtol=0)
    # and our own loader reads the same model back from the same files
    back = Transformer.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_a_final_save_over_an_older_run_drops_what_no_longer_belongs(tmp_path):
    # An earlier save left shards and a calibration map (a removed feature, docs/method.md §16): the new
    # model's save into the same folder removes both, so neither sits beside the new weights.
    out, model, tok = saved(tmp_path, "mars")
    (out / "model.safetensors").rename(out / "model-00001-of-00002.safetensors")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "calibration.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    checkpoint.save_checkpoint(out, model, tok, asdict(replace(train.Settings(), mode="mars")), model.state_dict(),
                               torch.float32)
    names = {f.name for f in out.iterdir()}
    assert "model.safetensors" in names and "notes.txt" in names
    assert not names & {"model-00001-of-00002.safetensors", "model.safetensors.index.json", "calibration.json"}
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(Transformer.from_pretrained(out)(x), model(x))


def test_the_final_save_writes_and_moves_its_files_inside_its_folder(tmp_path, monkeypatch):
    # --out may be a mount point (a container's volume): a rename from the folder above it would cross devices.
    (tmp_path / ".tmp-mars").mkdir()  # a folder of the user's that only happens to have the old temporary name
    (tmp_path / ".tmp-mars" / "notes.txt").write_text("mine")
    moves, real = [], checkpoint.os.replace
    monkeypatch.setattr(checkpoint.os, "replace", lambda src, dst: moves.append((src, dst)) or real(src, dst))
    out = saved(tmp_path, "mars")[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-mars", "mars"]
    assert (tmp_path / ".tmp-mars" / "notes.txt").read_text() == "mine" and not (out / ".tmp-final").exists()
    assert moves and all(Path(src).is_relative_to(out) and Path(dst).parent == out for src, dst in moves)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_checkpoints_go_by_step_and_a_killed_runs_partial_saves_go_at_the_next_run(tmp_path, capsys):
    # Past step 999,999 the names outgrow their zero padding: the order is the steps', so --keep drops the
    # oldest and --resume takes the newest. A save or delete a kill cut short (.tmp-*, .deleting-*) holds
    # nothing a run reads, and can be as large as the model: the next run in the folder removes it.
    for name in ("step-999998", "step-1000000", "step-999999", ".deleting-step-000004", ".tmp-step-000012",
                 "step-000010-copy", "step-²"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        for file in ("train_state.pt", "model.safetensors"):
            (tmp_path / "checkpoints" / name / file).write_bytes(b"x")
    (tmp_path / ".tmp-final").mkdir()  # the final save's
    (tmp_path / ".tmp-final" / "model.safetensors").write_bytes(b"x")
    assert [c.name for c in checkpoint.checkpoints(tmp_path)] == ["step-999998", "step-999999", "step-1000000"]
    checkpoint.keep_newest(tmp_path, 2)  # a folder the user named otherwise is neither a checkpoint nor pruned
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        ".deleting-step-000004", ".tmp-step-000012", "step-000010-copy", "step-1000000", "step-999999", "step-²"]
    capsys.readouterr()
    with checkpoint.one_run(tmp_path, one_process()):
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
            "step-000010-copy", "step-1000000", "step-999999", "step-²"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", checkpoint.LOCK]
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 3 and all("a killed run left unfinished" in line for line in said)
    with checkpoint.one_run(tmp_path, one_process()):  # nothing left over: nothing said
        pass
    assert capsys.readouterr().out == ""


def test_a_model_with_its_adapter_attached_saves_the_base_alone(tmp_path):
    from mars import adapter
    model = tiny_model(0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    adapter.attach(model, 259, rank=4, alpha=8.0)
    model.save_pretrained(tmp_path / "m")
    again = Transformer.from_pretrained(tmp_path / "m").state_dict()
    assert again.keys() == base.keys() and all(torch.equal(again[k], base[k]) for k in base)


def test_a_server_on_a_checkpoint_with_a_calibration_map_says_once_that_it_is_ignored(mars, tmp_path, capsys):
    # Calibrated thresholds were removed (docs/method.md §16): serve.py loads such a checkpoint as before,
    # and one line on stderr says the map is ignored (generate.py's and eval.py's: their own tests).
    import shutil

    from mars import serve

    path = tmp_path / "ckpt"
    shutil.copytree(mars[0], path)
    (path / "calibration.json").write_text('{"version": 2, "slots": [{"lo": [0.0], "p": [0.9], "n": [3]}]}')
    server = serve.launch(serve.Settings(ckpt=str(path), port=0, quiet=True, draft_budget="0"))
    server.close()
    notes = [line for line in capsys.readouterr().err.splitlines() if "calibration.json" in line]
    assert notes == [f"note: {path / 'calibration.json'} is ignored: calibrated thresholds were removed "
                     "(docs/method.md §16)"]


# ---- writing a run: the lock, the files' modes, the lines on the screen ----

def one_process():
    from mars.distributed import Env

    return Env(rank=0, world=1, local_rank=0, device=torch.device("cpu"), compute=torch.float32)


def test_every_saved_file_gets_the_mode_of_a_new_file(tmp_path):
    # safetensors writes its file 0600, which the other users of a shared run could not read: a saved
    # checkpoint's files, the final model's and a step's alike, all get 0o666 less the umask.
    import os

    umask = os.umask(0o022)
    try:
        out, model, tok = saved(tmp_path, "mars")
        step = tmp_path / "checkpoints" / "step-000001"
        checkpoint.save_checkpoint(step, model, tok, asdict(train.Settings()), model.state_dict(), torch.float32,
                                   state={"step": 1})
    finally:
        os.umask(umask)
    for folder in (out, step):
        modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert (step / "train_state.pt").is_file()


def test_a_run_removes_its_lock_and_the_empty_folder_it_made(tmp_path):
    import os

    out = tmp_path / "runs" / "new"
    with pytest.raises(ValueError, match="bad data"):
        with checkpoint.one_run(out, one_process()):
            assert (out / checkpoint.LOCK).read_text() == f"{os.getpid()}\n"
            raise ValueError("bad data")  # a run that fails before it writes anything
    assert not (tmp_path / "runs").exists()  # it made runs/ and runs/new, and leaves neither
    with checkpoint.one_run(out, one_process()):
        (out / "metrics.jsonl").write_text("")
    assert [f.name for f in out.iterdir()] == ["metrics.jsonl"]  # the lock goes, the run's own file stays
    (tmp_path / "mine").mkdir()
    with checkpoint.one_run(tmp_path / "mine", one_process()):
        pass
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())  # the user's own folder stays


def test_a_run_that_opened_a_lock_file_about_to_go_locks_a_new_one(tmp_path, monkeypatch):
    # Run A ends (it deletes its lock file while it holds it, then lets go) after run B opened that file and
    # before B locks it: B must lock a new file at the path, or a run C that creates one would run beside B.
    import fcntl
    import os

    out = tmp_path / "run"
    out.mkdir()
    (out / checkpoint.LOCK).write_text("4242\n")
    real, locked = fcntl.flock, []

    def flock(f, op):
        if not locked:
            (out / checkpoint.LOCK).unlink()  # run A ends now
        real(f, op)
        path = out / checkpoint.LOCK  # is the file locked the one at the path?
        locked.append(path.exists() and os.stat(path).st_ino == os.fstat(f.fileno()).st_ino)

    monkeypatch.setattr(fcntl, "flock", flock)
    with checkpoint.one_run(out, one_process()):
        assert locked == [False, True]  # the gone file's lock let go of, the new file's held
        assert (out / checkpoint.LOCK).read_text() == f"{os.getpid()}\n"


def test_off_a_terminal_a_step_line_is_printed_at_least_every_30_seconds(tmp_path, capsys):
    # Piped (`make quickstart | tee`, nohup, CI) no line is drawn in place: besides the kept lines, a step's
    # line is printed once 30 s have passed since the last one, so a stage is never silent for minutes.
    now = [0.0]
    stats = {"lr": 1e-3, "grad_norm": 1.0, "tokens": 700, "epoch": 0, "dt": 7.0}
    with checkpoint.Metrics(tmp_path, one_process(), mars=False, now=lambda: now[0]) as metrics:
        for step in range(1, 21):  # 7 s a step; only the last step's line is kept by the step rule
            now[0] += 7.0
            metrics.train(step, 20, [2.0, 2.0], stats, eta=7.0 * (20 - step), keep=step == 20)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 5/20", "step 10/20", "step 15/20", "step 20/20"]
    assert "eta 1.8 min" in lines[0]  # the line says how far and how long
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 20  # the file has every step


def test_a_full_disk_under_metrics_jsonl_is_named_with_its_fix(tmp_path):
    # A row the disk refuses stays in the file's buffer, and closing the file flushes it again: that second,
    # bare "[Errno 28]" must not replace the error that names the file and the fix.
    class FullDisk:
        name = str(tmp_path / "metrics.jsonl")

        def write(self, text):
            pass

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        close = flush

    stats = {"lr": 1e-3, "grad_norm": 1.0, "tokens": 700, "epoch": 0, "dt": 7.0}
    with pytest.raises(OSError, match=f"^no space left on {tmp_path} to write metrics.jsonl: free some space"):
        with checkpoint.Metrics(tmp_path, one_process(), mars=False) as metrics:
            metrics.file.close()
            metrics.file = FullDisk()
            metrics.train(1, 2, [2.0, 2.0], stats, eta=7.0, keep=True)
