# A training run's bookkeeping around train.py's loop (mars/run.py, mars/checkpoint.py, mars/distributed.py):
# --minutes ends a run in time and a resume keeps its clock, one run to a folder, kills and full disks leave
# whole checkpoints and one line, a gradient that is not finite stops the run before its update, and the
# mask token's embedding row.
import errno
import io
import json
import math
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import mars.run
import train
from conftest import LOSS_MODEL, child, tiny_model, tiny_run_dir
from mars import checkpoint
from mars.checkpoint import ensure_mask_row
from mars.distributed import Env
from mars.run import WallClock
from mars.tokenizer import Tokenizer
from mars.train_settings import Settings
from model import Transformer

ROOT = Path(__file__).resolve().parents[2]
# before any test replaces them
REAL_CLOCK, REAL_UPDATE, REAL_EVALUATE = train.WallClock, train.update, train.evaluate
REAL_SAVE_STEP, REAL_SAVE_FINAL = mars.run.save_step, mars.run.save_final


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run_dir(tmp_path_factory.mktemp("tiny"), chats=48)


def run(tiny, out, *flags):
    argv = ["--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"), "--out", str(out),
            "--device", "cpu", "--eval-fraction", "0", *flags]
    train.main(argv)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def strip(rows):  # wall-clock fields differ between runs
    return [{k: v for k, v in r.items() if k != "dt"} for r in rows]


def test_the_clock_counts_a_resumed_runs_spent_seconds():
    now = [100.0]
    clock = WallClock(1.0, spent=20.0, now=lambda: now[0])
    now[0] += 10
    assert clock.elapsed() == 30 and clock.share() == 0.5 and clock.left() == 30
    assert clock.fits(30) and not clock.fits(30.5)
    free = WallClock(0.0, now=lambda: now[0])
    assert free.share() == 0 and free.fits(1e9) and free.left() == float("inf")


class FakeClock:
    # Each optimizer step takes `per_step` seconds on train.WallClock's clock, and each held-out eval `per_eval`,
    # whatever they take on the machine.
    def __init__(self, monkeypatch, per_step: float, per_eval: float = 0.0, per_save: float = 0.0):
        self.t = 0.0
        fake = self

        def saving(real):
            def save(*args):
                fake.t += per_save
                return real(*args)
            return save

        monkeypatch.setattr(mars.run, "save_step", saving(REAL_SAVE_STEP))
        monkeypatch.setattr(mars.run, "save_final", saving(REAL_SAVE_FINAL))

        def update(*args):
            fake.t += per_step
            return REAL_UPDATE(*args)

        def evaluate(*args):
            fake.t += per_eval
            return REAL_EVALUATE(*args)

        monkeypatch.setattr(train, "evaluate", evaluate)

        class Clock(REAL_CLOCK):
            def __init__(self, minutes: float, spent: float = 0.0):
                super().__init__(minutes, spent, now=lambda: fake.t)

        monkeypatch.setattr(train, "update", update)
        monkeypatch.setattr(train, "WallClock", Clock)


def test_minutes_end_the_run_in_time_with_the_lr_decayed_by_the_clock(tiny, tmp_path, monkeypatch):
    # 10 s a step on a 60 s budget, and a step cap far away: step 6 ends at 60 s, where one more step no
    # longer fits. Each step's lr is the cosine at the budget's share spent before it; the last step
    # still gets its eval, and the model is saved.
    FakeClock(monkeypatch, per_step=10.0)
    peak = 3e-3
    rows = run(tiny, tmp_path / "a", "--lr", str(peak), "--batch-size", "4", "--global-batch", "8",
               "--max-steps", "1000", "--warmup", "0", "--minutes", "1", "--save-every", "0",
               "--eval-every", "100", "--eval-fraction", "0.2")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in steps] == pytest.approx([peak * 0.5 * (1 + math.cos(math.pi * i / 6))
                                                      for i in range(6)])
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 6]
    assert (tmp_path / "a" / "model.safetensors").exists()


def test_minutes_leave_room_for_the_eval_due_at_a_step(tiny, tmp_path, monkeypatch):
    # Steps of 10 s, evals of 8 s every 2 steps, a 50 s budget. At step 2 (28 s in) one more step would fit
    # with the final eval (46 s), but not after step 2's own eval as well (54 s): so step 2 is the last, and
    # its eval is the final one. The run ends at 36 s, within the budget.
    clock = FakeClock(monkeypatch, per_step=10.0, per_eval=8.0)
    rows = run(tiny, tmp_path / "a", "--lr", "3e-3", "--batch-size", "4", "--global-batch", "8",
               "--max-steps", "1000", "--warmup", "0", "--minutes", str(50 / 60), "--save-every", "0",
               "--eval-every", "2", "--eval-fraction", "0.2")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2] and clock.t == 36


def test_minutes_leave_room_for_the_saves_of_a_stopped_run(tiny, tmp_path, monkeypatch):
    # Steps of 10 s, saves of 5 s every 2 steps, a 53 s budget. After step 3 (35 s) one more step and the
    # final save would fit (50 s), but not one more step and the two saves of a run the budget stops (a
    # mean step of 11.7 s with the save: 57 s). So step 3 is the last: it saves a step checkpoint to resume
    # from, then the model, and the run ends at 45 s.
    clock = FakeClock(monkeypatch, per_step=10.0, per_save=5.0)
    rows = run(tiny, tmp_path / "a", "--lr", "3e-3", "--batch-size", "4", "--global-batch", "8",
               "--max-steps", "1000", "--warmup", "0", "--minutes", str(53 / 60), "--save-every", "2",
               "--keep", "2", "--eval-every", "0")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3] and clock.t == 45
    assert [c.name for c in checkpoint.checkpoints(tmp_path / "a")] == ["step-000002", "step-000003"]


def test_a_warmup_under_minutes_starts_with_the_loop_not_the_loading(tiny, tmp_path, monkeypatch):
    # Loading takes 30 s of a 100 s budget (--warmup 0.1: 10 s): warmup still rises over the first step's
    # 5 s (half of it) and ends after the second, by the clock, although 40 warmup steps were set.
    clock = FakeClock(monkeypatch, per_step=5.0)
    real_split = train.split_data

    def slow_split(*args):
        clock.t += 30.0
        return real_split(*args)

    monkeypatch.setattr(train, "split_data", slow_split)
    peak = 1e-3
    rows = run(tiny, tmp_path / "a", "--lr", str(peak), "--batch-size", "4", "--global-batch", "8",
               "--max-steps", "400", "--warmup", "0.1", "--minutes", str(100 / 60), "--save-every", "0",
               "--eval-every", "0")
    lrs = [r["lr"] for r in rows if "loss" in r]
    assert lrs[0] == pytest.approx(peak / 40) and lrs[1] == pytest.approx(peak / 2)
    assert lrs[2] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 0.4)))  # 40 s of 100 spent before step 3


@pytest.mark.parametrize("warmup", ["0", "0.2"])
def test_a_resumed_run_keeps_its_minutes(tiny, tmp_path, monkeypatch, warmup):
    # Killed after step 5, past the step-4 checkpoint (40 s spent): the resumed run goes on from 40 s, so it
    # repeats the unbroken run's steps, learning rates and end. With --warmup 0.2 (12 s, while its 200 steps
    # would take 2,000 s) the clock ends the warmup after step 2, and a resumed run does not begin it again.
    # A run whose budget is spent says so.
    flags = ["--lr", "3e-3", "--batch-size", "4", "--global-batch", "8", "--max-steps", "1000",
             "--warmup", warmup, "--minutes", "1", "--save-every", "2", "--keep", "1", "--eval-every", "3",
             "--eval-fraction", "0.2"]
    real_lr_at = train.lr_at
    FakeClock(monkeypatch, per_step=10.0)
    unbroken = run(tiny, tmp_path / "a", *flags)

    def crash_at_step_6(step, *args):
        if step == 5:
            raise KeyboardInterrupt
        return real_lr_at(step, *args)

    FakeClock(monkeypatch, per_step=10.0)
    monkeypatch.setattr(train, "lr_at", crash_at_step_6)
    with pytest.raises(SystemExit, match="^130$"):  # Ctrl-C
        run(tiny, tmp_path / "b", *flags)
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    FakeClock(monkeypatch, per_step=10.0)  # a new process: its clock starts again at 0
    resumed = run(tiny, tmp_path / "b", *flags, "--resume")
    assert strip(resumed) == strip(unbroken) and unbroken[-1]["step"] == 6
    # The budget stopped both at step 6, and each left a step checkpoint there to go on from.
    assert [c.name for c in checkpoint.checkpoints(tmp_path / "b")] == ["step-000006"]
    with pytest.raises(SystemExit, match=r"step-000006: the run spent 1.0 min of its --minutes 0.5 and has no room"):
        run(tiny, tmp_path / "b", *flags, "--minutes", "0.5", "--resume")
    with pytest.raises(SystemExit, match=r"spent 1.0 min of its --minutes 1.1 and has no room for another step"):
        run(tiny, tmp_path / "b", *flags, "--minutes", "1.1", "--resume")  # 60 s + a 10 s step > 66 s
    rows = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == 6  # the refused resumes cut no rows
    # A larger budget trains on from step 6, 60 s in: six more steps to 120 s, the rate decayed by the new
    # budget's share (so it rises again first).
    FakeClock(monkeypatch, per_step=10.0)
    more = run(tiny, tmp_path / "b", *flags, "--minutes", "2", "--resume")
    steps = [r for r in more if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13)) and strip(more[:len(unbroken)]) == strip(unbroken)
    assert [r["lr"] for r in steps[6:]] == pytest.approx([3e-3 * 0.5 * (1 + math.cos(math.pi * (60 + 10 * i) / 120))
                                                          for i in range(6)])


def test_a_run_folder_without_its_final_model_names_its_newest_checkpoint(tiny, tmp_path):
    # A stage-1 run killed (or still training) holds step checkpoints and no model: --init and --ckpt on it say
    # which checkpoint to pass, or how to finish the run, and that checkpoint works.
    import generate

    out = tmp_path / "stage1"
    run(tiny, out, "--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--max-steps", "4", "--save-every",
        "2", "--eval-every", "0")
    for f in out.iterdir():
        if f.is_file() and f.name != "metrics.jsonl":
            f.unlink()
    newest = out / "checkpoints" / "step-000004"
    says = (rf"{out}: a training run with no final model yet \(killed, or still running\); pass its newest checkpoint, "
            rf"{{}} {newest}, or finish the run first: python train.py --out {out} --resume")
    with pytest.raises(SystemExit, match=says.format("--ckpt")):
        generate.main(["--ckpt", str(out), "--prompt", "hi"])
    with pytest.raises(SystemExit, match=says.format("--init")):
        run(tiny, tmp_path / "stage2", "--init", str(out))
    generate.main(["--ckpt", str(newest), "--prompt", "hi", "--max-new-tokens", "2"])


def test_a_run_whose_split_holds_nothing_out_says_it_runs_no_eval(tiny, tmp_path, capsys):
    flags = ["--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--max-steps", "1", "--save-every", "0"]
    rows = run(tiny, tmp_path / "a", *flags, "--eval-every", "5", "--quiet")  # --eval-fraction 0
    assert not any("eval_loss" in r for r in rows)
    assert ("warning: --eval-fraction 0 of 48 examples holds none out, so --eval-every 5 runs no eval; raise "
            "--eval-fraction, give --eval-data, or pass --eval-every 0\n") in capsys.readouterr().out
    run(tiny, tmp_path / "b", *flags, "--eval-every", "0")
    assert "runs no eval" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--eval-fraction 0.999 held out all 48 examples of --data .*, leaving none "
                                         r"to train on; lower --eval-fraction or --eval-max"):
        run(tiny, tmp_path / "c", *flags, "--eval-every", "5", "--eval-fraction", "0.999")


def test_the_held_out_rows_stay_held_out_when_other_rows_or_the_cut_change(tmp_path):
    # Two stages on one file, the second with another --max-len and --block-size that drop some rows: a row is
    # held out in both or in neither while both have it, so the second stage's eval loss is not on rows the
    # first trained. Every row opens with one long system prompt, which the choice looks past. Under
    # --eval-max, the held-out rows are the same lowest ones.
    rows = []
    for i in range(200):
        user = f"task {i}: " + ("pad " * 40 if i % 4 == 0 else "")  # every 4th prompt passes --max-len 380
        turns = [("system", "s" * 300), ("user", user), ("assistant", f"answer {i}")]
        rows.append(json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(rows))
    env = Env(rank=0, world=1, local_rank=0, device=torch.device("cpu"), compute=torch.float32)

    def prompts(ex):  # each example's tokens before its first supervised one
        return {tuple(ex[i][0][:int(ex[i][1].argmax())].tolist()) for i in range(len(ex))}

    def split(max_len, block_size, most=1000):
        s = Settings(data=str(tmp_path / "a.jsonl"), max_len=max_len, block_size=block_size, eval_fraction=0.2,
                     eval_max=most, eval_every=5, quiet=True)
        train, held = mars.run.split_data(s, Tokenizer.byte_level(), env, context=1024)
        return prompts(train), prompts(held)

    train_a, held_a = split(1024, 4)
    train_b, held_b = split(380, 8)
    assert len(train_a | held_a) == 200 and len(train_b | held_b) == 150 and 20 < len(held_a) < 60
    assert held_a & (train_b | held_b) == held_b and not held_b & train_a  # the same rows, where both have them
    number = {p: int(bytes(t for t in p if t < 256).split(b"task ")[1].split(b":")[0]) for p in train_a | held_a}
    assert {number[p] for p in held_a} != set(range(len(held_a)))  # not the file's first rows
    few_a, few_b = split(1024, 4, most=5)[1], split(380, 8, most=5)[1]
    assert len(few_b) == 5 and few_b < held_b and few_a & (train_b | held_b) <= few_b  # the lowest where both have


def test_a_run_that_resumed_from_a_stop_under_save_every_0_is_done_when_it_ends(tiny, tmp_path, monkeypatch):
    # --save-every 0 asks for the model alone, but --minutes stopped the run with a step checkpoint to go on
    # from; the resumed run ends with one at its last step too, so that a third --resume finds the run done
    # rather than training the stop's steps again over the finished model.
    flags = ["--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--max-steps", "8", "--save-every", "0",
             "--eval-every", "0"]
    FakeClock(monkeypatch, per_step=10.0)
    rows = run(tiny, tmp_path, *flags, "--minutes", "1")
    assert rows[-1]["step"] < 8 and len(checkpoint.checkpoints(tmp_path)) == 1
    FakeClock(monkeypatch, per_step=10.0)
    assert run(tiny, tmp_path, *flags, "--minutes", "2", "--resume")[-1]["step"] == 8
    assert [c.name for c in checkpoint.checkpoints(tmp_path)] == ["step-000006", "step-000008"]  # --keep 2
    model = (tmp_path / "model.safetensors").read_bytes()
    FakeClock(monkeypatch, per_step=10.0)
    with pytest.raises(SystemExit, match=r"step-000008: the run already reached step 8 of 8"):
        run(tiny, tmp_path, *flags, "--minutes", "2", "--resume")
    assert (tmp_path / "model.safetensors").read_bytes() == model


def test_mask_row_is_reused_or_grown():
    for tied in (True, False):
        # ids 0..98: no spare row for mask id 99
        model = tiny_model(0, **{**LOSS_MODEL, "vocab_size": 99}, tie_word_embeddings=tied)
        old = model.model.embed_tokens.weight.detach().clone()
        ensure_mask_row(model, 99)
        w = model.model.embed_tokens.weight
        assert w.shape == (100, 32) and model.config.vocab_size == 100
        assert torch.equal(w[:99], old) and torch.allclose(w[99], old.mean(0))
        if not tied:
            assert model.lm_head.weight.shape == (100, 32)
        assert model(torch.tensor([[1, 99, 2]])).shape == (1, 3, 100)
    model = tiny_model(0, **LOSS_MODEL)  # a spare row: untouched by default, the mean on request
    row = model.model.embed_tokens.weight[99].detach().clone()
    ensure_mask_row(model, 99)
    assert torch.equal(model.model.embed_tokens.weight[99], row)
    ensure_mask_row(model, 99, "mean")
    w = model.model.embed_tokens.weight
    assert w.shape[0] == 100 and torch.allclose(w[99], w[:99].mean(0))


def test_a_run_killed_before_its_first_checkpoint_starts_fresh_under_resume(tiny, tmp_path):
    # A real training process, killed (SIGKILL) once it has logged a step but before any checkpoint.
    import signal
    import time

    out = tmp_path / "run"
    argv = [sys.executable, "train.py", "--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"),
            "--out", str(out), "--device", "cpu", "--eval-fraction", "0", "--eval-every", "0", "--batch-size", "4",
            "--global-batch", "8", "--max-steps", "400", "--save-every", "300"]
    with child(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not checkpoint.checkpoints(out)
    stale = (out / "metrics.jsonl").read_text()
    rows = run(tiny, out, "--batch-size", "4", "--global-batch", "8", "--max-steps", "2", "--save-every", "0",
               "--eval-every", "0", "--resume")
    assert [r["step"] for r in rows] == [1, 2]  # a fresh run, nothing appended to the old rows
    assert (out / "metrics.jsonl.stale-1").read_text() == stale


def test_a_run_killed_while_it_saves_and_deletes_checkpoints_always_resumes(tiny, tmp_path):
    # A checkpoint every step and only the newest kept: a save and a delete run in most of each step, so
    # kills after 3, 6 and 9 logged rows land in them; whatever each kill hit, every listed checkpoint is
    # whole and --resume goes on from the newest.
    import signal
    import time

    out = tmp_path / "run"
    flags = ["--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"), "--out", str(out), "--device", "cpu",
             "--eval-fraction", "0", "--eval-every", "0", "--batch-size", "4", "--global-batch", "4",
             "--max-steps", "60", "--save-every", "1", "--keep", "1"]
    for rows in (3, 6, 9):
        with child([sys.executable, "train.py", *flags, "--resume"], cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
            deadline = time.monotonic() + 120
            while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= rows):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for ckpt in checkpoint.checkpoints(out):  # whole: weights that load, and a train state
            Transformer.from_pretrained(ckpt, "cpu")
            assert torch.load(ckpt / "train_state.pt", weights_only=True)["step"] >= 1
    last = checkpoint.checkpoints(out)[-1]
    step = torch.load(last / "train_state.pt", weights_only=True)["step"]
    rows = run(tiny, out, *flags[6:], "--resume")  # the rest of the run, from the newest checkpoint
    assert rows[-1]["step"] == 60 and [r["step"] for r in rows] == list(range(1, 61))
    assert step >= 1


def test_one_run_per_folder_and_a_dead_runs_lock_is_taken_over(tiny, tmp_path):
    # A run holds an flock on OUT/train.lock: a second run on the same --out stops at once (before it
    # reads --data, which is missing here), naming the holder's PID. The kernel drops a flock with its
    # process, so the lock file a dead run left behind stops nobody. A run that ends removes its lock
    # file, and the --out folder it created when it leaves nothing there.
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    with open(out / checkpoint.LOCK, "w") as held:  # another run, alive: its open file holds the lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        with pytest.raises(SystemExit, match=r"in use by another training run \(PID 4242") as e:
            train.main(["--init", "tiny", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)])
        assert "\n" not in str(e.value) and str(e.value).startswith("error: ")
    # the holder is gone and its file stays, naming a dead PID
    assert (out / checkpoint.LOCK).read_text() == "4242\n"
    run(tiny, out, "--batch-size", "4", "--global-batch", "4", "--max-steps", "1", "--eval-every", "0")
    assert not (out / checkpoint.LOCK).exists() and (out / "model.safetensors").is_file()
    # every file the run wrote has the mode open() gives a new file (safetensors' own is 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir() if f.is_file()}
    assert set(modes.values()) == {modes["settings.json"]}, modes
    # a run that fails before it writes anything leaves no --out behind
    with pytest.raises(SystemExit, match="missing.jsonl: no such file"):
        train.main(["--init", "tiny", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "new" / "x"),
                    "--device", "cpu"])
    assert not (tmp_path / "new").exists()


def test_a_full_disk_stops_the_run_with_one_line_and_no_partial_checkpoint(tiny, tmp_path, monkeypatch):
    def full_disk(tmp, *args):  # the weights half written, then the disk is full
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_model", full_disk)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run(tiny, out, "--batch-size", "4", "--global-batch", "4", "--max-steps", "2", "--save-every", "1",
            "--eval-every", "0")
    message = str(e.value)
    assert message.startswith(f"error: no space left on {out / 'checkpoints'} to save step-000001")
    assert "--keep" in message and "--out" in message and "\n" not in message
    assert "--resume" not in message  # no checkpoint yet to go on from
    with pytest.raises(SystemExit) as e:  # keeping one already: fewer is no advice
        run(tiny, tmp_path / "one", "--batch-size", "4", "--global-batch", "4", "--max-steps", "2", "--save-every",
            "1", "--eval-every", "0", "--keep", "1")
    assert "--keep" not in str(e.value) and "free some space, or choose another --out" in str(e.value)
    assert list((out / "checkpoints").iterdir()) == []  # the partial .tmp-step-000001 is gone
    # Ctrl-C while a checkpoint is written: the partial folder goes too.
    monkeypatch.setattr(checkpoint, "save_model", lambda tmp, *a: (tmp.mkdir(parents=True), (_ for _ in ()).throw(
        KeyboardInterrupt)))
    with pytest.raises(SystemExit, match="^130$"):
        run(tiny, tmp_path / "ctrl-c", "--batch-size", "4", "--global-batch", "4", "--max-steps", "2",
            "--save-every", "1", "--eval-every", "0")
    assert list((tmp_path / "ctrl-c" / "checkpoints").iterdir()) == []


def test_a_full_disk_at_the_final_save_loses_no_step(tiny, tmp_path, monkeypatch):
    # safetensors removes its partial file before it raises, so the disk looks roomy again: its message, which
    # keeps the OS's, names the full disk. The last step has its step checkpoint by then: --resume trains
    # nothing again and saves the model.
    real = checkpoint.save_model

    def full_at_the_end(tmp, model, tok, mars, weights, dtype):
        if not tmp.name.startswith(".tmp-step"):
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tmp, model, tok, mars, weights, dtype)

    monkeypatch.setattr(checkpoint, "save_model", full_at_the_end)
    out = tmp_path / "run"
    flags = ["--batch-size", "4", "--global-batch", "4", "--max-steps", "3", "--save-every", "2", "--eval-every", "0"]
    with pytest.raises(SystemExit, match=rf"^error: no space left on {out} to save run \(the partial .tmp-final ") as e:
        run(tiny, out, *flags)
    assert str(e.value).endswith("or choose another --out; --resume then goes on from step-000003")
    assert [c.name for c in checkpoint.checkpoints(out)] == ["step-000002", "step-000003"]
    monkeypatch.setattr(checkpoint, "save_model", real)
    rows = (out / "metrics.jsonl").read_text()
    assert run(tiny, out, *flags, "--resume")[-1]["step"] == 3 and (out / "metrics.jsonl").read_text() == rows
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    with pytest.raises(SystemExit, match=r"step-000003: the run already reached step 3 of 3"):
        run(tiny, out, *flags, "--resume")
    assert not checkpoint.disk_full(RuntimeError("Error while serializing: I/O error"), tmp_path)
    # Trained on to step 4 over that model, and the final save fails again: the step-3 model still in OUT is not
    # taken for step 4's, so --resume saves step 4's.
    monkeypatch.setattr(checkpoint, "save_model", full_at_the_end)
    more = [*flags[:5], "4", *flags[6:], "--resume"]
    with pytest.raises(SystemExit, match="no space left"):
        run(tiny, out, *more)
    monkeypatch.setattr(checkpoint, "save_model", real)
    rows = (out / "metrics.jsonl").read_text()
    assert run(tiny, out, *more)[-1]["step"] == 4 and (out / "metrics.jsonl").read_text() == rows
    with pytest.raises(SystemExit, match=r"step-000004: the run already reached step 4 of 4"):
        run(tiny, out, *more)


def test_a_damaged_settings_file_or_metrics_row_is_named_with_the_way_on(tiny, tmp_path):
    flags = ["--batch-size", "4", "--global-batch", "4", "--max-steps", "4", "--save-every", "2", "--keep", "2",
             "--eval-every", "0"]
    out = tmp_path / "run"
    run(tiny, out, *flags)
    settings = out / "checkpoints" / "step-000004" / "settings.json"
    saved = settings.read_bytes()
    for damage in (b'{"mode": ', b"[1]"):
        settings.write_bytes(damage)
        with pytest.raises(SystemExit, match=rf"step-000004: this checkpoint cannot be read \(ValueError: {settings}.*"
                                             r"Delete it and --resume goes on from step-000002"):
            run(tiny, out, *flags, "--max-steps", "6", "--resume")
    settings.write_bytes(saved)
    metrics = out / "metrics.jsonl"
    rows = metrics.read_bytes()
    for bad in (b"{}\n", b"\xff\n"):
        metrics.write_bytes(rows.replace(b"\n", b"\n" + bad, 1))  # after row 1
        with pytest.raises(SystemExit, match=rf"error: {metrics}:2: not a "):
            run(tiny, out, *flags, "--max-steps", "6", "--resume")
    metrics.write_bytes(rows)
    assert [r["step"] for r in run(tiny, out, *flags, "--max-steps", "6", "--resume")] == list(range(1, 7))


class FullFile(io.StringIO):
    # A file on a full disk: every write fails as the kernel fails it.
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_under_the_metrics_file_is_one_line_and_the_file_is_closed(tiny, tmp_path, monkeypatch):
    opened = []

    def open_full(file, mode="r", *args, **kw):  # metrics.jsonl lands on a full disk; other files do not
        if Path(file).name != "metrics.jsonl":
            return open(file, mode, *args, **kw)
        opened.append(FullFile(str(file)))
        return opened[-1]

    monkeypatch.setattr(checkpoint, "open", open_full, raising=False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run(tiny, out, "--batch-size", "4", "--global-batch", "4", "--max-steps", "2", "--eval-every", "0")
    assert str(e.value) == (f"error: no space left on {out} to write metrics.jsonl: free some space or choose "
                            "another --out")
    assert len(opened) == 1 and opened[0].closed  # closed as the run stopped


def test_only_complete_checkpoints_are_listed_and_deletion_renames_first(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for name, files in (("step-000002", ["train_state.pt", "model.safetensors", "config.json"]),
                        ("step-000004", ["train_state.pt"]),  # weights gone: a delete killed mid-way
                        ("step-000006", ["train_state.pt", "adapter.safetensors", "mars_adapter.json"]),
                        (".tmp-step-000008", ["train_state.pt", "model.safetensors"]),  # a save killed mid-way
                        (".deleting-step-000001", ["train_state.pt", "model.safetensors"])):
        (root / name).mkdir(parents=True)
        for f in files:
            (root / name / f).write_text("x")
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000002", "step-000006"]
    # a delete killed after its rename leaves nothing that is listed
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda p, **kw: (_ for _ in ()).throw(KeyboardInterrupt)
                        if not kw else None)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.delete_checkpoint(root / "step-000002")
    assert (root / ".deleting-step-000002" / "model.safetensors").exists()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000006"]


@pytest.mark.parametrize(("env", "device", "expected"), [
    ({}, "cuda", 0), ({}, "cuda:1", 1), ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, "cuda", 3)])
def test_each_process_takes_a_gpu_that_set_device_accepts(monkeypatch, env, device, expected):
    # One GPU without torchrun (train.py --device cuda, or auto on a GPU machine) must name its index:
    # torch.cuda.set_device refuses a bare "cuda". The real set_device runs, up to the driver call.
    from mars import distributed
    taken, groups = [], []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", taken.append, raising=False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: groups.append((a, k)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    here = distributed.setup(device, torch.bfloat16, fsdp=False).device
    assert taken == [expected] and here == torch.device("cuda", expected)
    # under torchrun the others wait for rank 0's checkpoint writes for up to an hour, not torch's 10 minutes
    assert groups == ([(("nccl",), {"timeout": timedelta(minutes=60)})] if env else [])


@pytest.mark.parametrize("saved_fused", [False, True])
def test_a_resumed_optimizer_steps_as_this_run_builds_it(saved_fused):
    # A run saved on one device and resumed on another (fused AdamW on CUDA only) steps as the resuming run
    # builds its optimizer, with the moments it saved.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from mars import distributed

    saved_model, model = tiny_model(0), tiny_model(0)
    opt = torch.optim.AdamW(saved_model.parameters(), lr=1e-3, fused=saved_fused)
    saved_model(torch.randint(0, 64, (2, 8))).float().logsumexp(-1).mean().backward()
    opt.step()
    state = get_optimizer_state_dict(saved_model, opt)
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not saved_fused)
    distributed.load_optimizer_state(model, resumed, state)
    assert all(g["fused"] is (not saved_fused) for g in resumed.param_groups)
    p = next(model.parameters())
    assert torch.equal(resumed.state[p]["exp_avg"], opt.state[next(saved_model.parameters())]["exp_avg"])
    model(torch.randint(0, 64, (2, 8))).float().logsumexp(-1).mean().backward()
    resumed.step()
    assert float(resumed.state[p]["step"]) == 2


def test_one_named_gpu_under_torchrun_is_refused(monkeypatch):
    # Every process would take cuda:1 (NCCL then hangs or fails far from the cause); one process may.
    from mars import distributed
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"--device cuda:1 under torchrun: each process takes its own GPU "
                                         r"\(LOCAL_RANK\); pass --device cuda"):
        distributed.setup("cuda:1", torch.float32, fsdp=False)


def test_fsdp_gathers_bf16_weights_and_reduces_float32_gradients():
    # --fsdp under bf16: each block computes with weights all-gathered in bf16, and the gradients are
    # reduce-scattered in float32 onto the float32 master shards; in float32 nothing is cast. One gloo
    # process shows the casts (tests/spec/test_train.py runs two).
    import torch.distributed as dist

    from mars import distributed

    assert distributed.precision(torch.bfloat16).reduce_dtype == torch.float32
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        for compute in (torch.bfloat16, torch.float32):
            model, seen = tiny_model(0).train(), []
            distributed.shard(model, compute)
            mlp = model.model.layers[0].mlp
            mlp.register_forward_hook(lambda m, i, o, seen=seen: seen.append(m.up_proj.weight.dtype))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute == torch.bfloat16), \
                    warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                h = model.hidden(torch.randint(0, 64, (2, 8))).flatten(0, 1)  # the loss's rows, as mars_loss
                model.head(h).float().logsumexp(-1).mean().backward()
            assert seen == [compute]
            assert not [w for w in warned if "view" in str(w.message)]  # FSDP2's warning of a view returned
            p = mlp.up_proj.weight  # the sharded master copy, between uses
            assert type(p).__name__ == "DTensor" and p.dtype == p.grad.dtype == torch.float32
    finally:
        dist.destroy_process_group()


def test_a_gradient_that_is_not_finite_stops_the_run_before_it_is_applied(tiny, tmp_path, monkeypatch):
    # The third step's gradient is nan: the run stops with one line naming the step and the fixes, the
    # attention kernel among the causes, before the weights take it, so nothing is saved after step 2 and
    # its checkpoint is not rotated away.
    real = torch.nn.utils.clip_grad_norm_
    calls = []

    def nan_at_step_3(params, clip):
        calls.append(1)
        return torch.tensor(float("nan")) if len(calls) == 3 else real(params, clip)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_at_step_3)
    out = tmp_path / "a"
    with pytest.raises(SystemExit, match=r"error: step 3: the gradient norm is nan at --lr .*, so the run stops "
                                         r"before this update; its last checkpoint, .*step-000002, is kept: lower "
                                         r"--lr or --grad-clip, or check the data at this step, then start again "
                                         r"with --resume\. On CUDA the attention kernel can cause it too: cuDNN's "
                                         r"SDPA gives NaN gradients with a mask \(pytorch/pytorch#196678\)") as e:
        run(tiny, out, "--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--max-steps", "10",
            "--save-every", "2", "--keep", "1", "--eval-every", "0")
    assert "\n" not in str(e.value)  # one line, however many causes it names
    assert [c.name for c in checkpoint.checkpoints(out)] == ["step-000002"]
    assert not (out / "model.safetensors").exists()
    state = Transformer.from_pretrained(out / "checkpoints" / "step-000002", "cpu", torch.float32).state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())


def test_a_sharded_step_checkpoint_is_readable(tiny, tmp_path):
    # A model over the shard size (a 7B) saves its steps sharded: the check opens each shard, never the index.
    out = tmp_path / "a"
    run(tiny, out, "--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--eval-every", "0",
        "--max-steps", "4", "--save-every", "2")
    step = out / "checkpoints" / "step-000002"
    Transformer.from_pretrained(step).save_pretrained(step, max_shard_size=20_000)
    assert (step / "model.safetensors.index.json").is_file() and not (step / "model.safetensors").exists()
    checkpoint.readable([step])  # no SystemExit
    (next(step.glob("model-*-of-*.safetensors"))).write_bytes(b"\0" * 64)
    with pytest.raises(SystemExit, match="step-000002: this checkpoint cannot be read"):
        checkpoint.readable([step])


def test_a_sharded_run_resumed_without_torchrun_goes_on_in_one_process(tmp_path, monkeypatch, capsys):
    # --fsdp is how a run was launched, as --device is where: outside torchrun --resume does not take it from the
    # run's settings (which would refuse to start), under torchrun it does.
    from mars.train_settings import parse_settings

    step = tmp_path / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "train_state.pt").write_bytes(b"")
    (step / "model.safetensors").write_bytes(b"")
    (step / "settings.json").write_text(json.dumps({"fsdp": True, "lr": 0.003, "init": "tiny"}))
    monkeypatch.delenv("RANK", raising=False)
    s = parse_settings(["--out", str(tmp_path), "--resume"])
    assert not s.fsdp and s.lr == 0.003
    assert "trained with --fsdp under torchrun; it goes on in this one process" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert parse_settings(["--out", str(tmp_path), "--resume"]).fsdp


def test_a_checkpoint_of_the_earlier_seeded_split_is_refused_by_name_and_its_model_trains_on(tiny, tmp_path, capsys):
    # A run saved before the split was drawn by prompt: its held-out rows would change under it, so --resume says
    # why and the way on, and --init takes the checkpoint's model.
    flags = ["--lr", "3e-3", "--batch-size", "4", "--global-batch", "4", "--eval-every", "2", "--eval-fraction", "0.2",
             "--save-every", "2"]
    out = tmp_path / "a"
    run(tiny, out, *flags, "--max-steps", "2")
    state_file = out / "checkpoints" / "step-000002" / "train_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["data"] = {k: v for k, v in state["data"].items() if k != "split"} | {"held_out": 9}
    torch.save(state, state_file)
    with pytest.raises(SystemExit, match=r"step-000002: saved by an earlier version of this code, whose held-out split "
                                         r"was drawn by --seed, not by prompt hash: resume with that version, or train "
                                         r"on from this checkpoint's model in another --out \(--init .*step-000002\)"):
        run(tiny, out, *flags, "--max-steps", "4", "--resume")
    with pytest.raises(SystemExit, match=r"--eval-fraction changed, which the held-out split follows"):  # a flag first
        run(tiny, out, *flags, "--max-steps", "4", "--eval-fraction", "0.3", "--resume")
    rows = run(tiny, tmp_path / "b", *flags, "--max-steps", "1", "--init", str(out / "checkpoints" / "step-000002"))
    assert rows[-1]["step"] == 1


def test_one_row_held_out_by_chance_stays_in_training(tmp_path):
    # Whether a row is held out is its hash's chance: one row at --eval-fraction 0.99 is trained, with the
    # warning that nothing is held out, not refused as a split that took everything.
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": "a"}]}) + "\n")
    env = Env(rank=0, world=1, local_rank=0, device=torch.device("cpu"), compute=torch.float32)
    s = Settings(data=str(tmp_path / "one.jsonl"), eval_fraction=0.99, eval_every=5, quiet=True)
    assert len(mars.run.held_out_rows(mars.run.load_examples(s.data, Tokenizer.byte_level(), s.max_len, s.block_size),
                                      0.99, 1000)) == 1
    train, held = mars.run.split_data(s, Tokenizer.byte_level(), env, context=4096)
    assert len(train) == 1 and len(held) == 0
