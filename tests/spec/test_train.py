# The MARS loss (docs/method.md §4) against plain causal forwards, and the training loop: losses go down,
# --resume repeats an unbroken run's metrics, two processes equal one.
import copy
import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import model as model_module
import train
from conftest import LOSS_MODEL, random_examples, tiny_model, tiny_run_dir
from data import fit_to_blocks, make_batch, step_batches
from mars.tokenizer import Tokenizer
from model import Transformer
from train import lr_at, mars_loss

ROOT = Path(__file__).resolve().parents[2]
MASK, PAD = 99, 98  # LOSS_MODEL's 100 ids: the mask is 99


def reference_losses(model, examples, B):
    # Position by position, with plain causal forwards only. The clean stream is an ordinary LM.
    # A noisy position p in block k sees the clean x[:kB], then its own block's noisy tokens up to
    # itself: that context is itself a causal prefix with positions 0..p, so its prediction is the
    # last logit of an ordinary forward on clean x[:kB] + noisy x~[kB:p+1] (docs/method.md §3-4).
    per_seq_ar, per_seq_mask = [], []
    for ids, sup in examples:
        x, s = torch.tensor(ids), torch.tensor(sup)
        noisy = torch.where(s, MASK, x)
        clean_logits = model(x[None])[0]
        ar, mk = [], []
        for p in range(len(x) - 1):
            if not s[p + 1]:
                continue
            ar.append(F.cross_entropy(clean_logits[p], x[p + 1]))
            k = p // B
            prefix = torch.cat([x[: k * B], noisy[k * B : p + 1]])
            mk.append(F.cross_entropy(model(prefix[None])[0, -1], x[p + 1]))
        per_seq_ar.append(torch.stack(ar).mean())
        per_seq_mask.append(torch.stack(mk).mean())
    return torch.stack(per_seq_ar).mean(), torch.stack(per_seq_mask).mean()


@pytest.mark.parametrize("B", [1, 2, 4, 8])
@pytest.mark.parametrize("prune", [True, False])
def test_losses_equal_the_causal_reference(B, prune):
    model = tiny_model(B, **LOSS_MODEL)
    examples = random_examples(B, seed=B)
    with torch.no_grad():
        loss, loss_ar, loss_mask = mars_loss(model, make_batch(examples, B, MASK, PAD, "mars", prune), 0.5)
        ref_ar, ref_mask = reference_losses(model, examples, B)
    assert abs(loss_ar - ref_ar) < 1e-5
    assert abs(loss_mask - ref_mask) < 1e-5
    assert abs(loss - (ref_mask + 0.5 * ref_ar)) < 1e-5
    assert abs(loss_mask - loss_ar) > 1e-2  # the two streams really differ


def test_loss_ar_is_the_sft_loss_and_pruning_changes_nothing():
    model = tiny_model(1, **LOSS_MODEL)
    examples = random_examples(4, seed=7, n=6)
    with torch.no_grad():
        # Plain SFT written out: one causal forward per sequence, the mean CE over its supervised
        # targets, then the mean over sequences (docs/method.md §4).
        per_seq = []
        for ids, sup in examples:
            x, s = torch.tensor(ids), torch.tensor(sup)
            logits = model(x[None])[0, :-1]
            per_seq.append(F.cross_entropy(logits[s[1:]], x[1:][s[1:]]))
        ref = torch.stack(per_seq).mean()
        # AR mode is the clean stream alone: its loss is the SFT loss, whatever ar_weight says.
        sft, sft_ar, sft_mask = mars_loss(model, make_batch(examples, 4, MASK, PAD, "ar"), 0.5)
        full = mars_loss(model, make_batch(examples, 4, MASK, PAD, "mars", prune=False))
        pruned = mars_loss(model, make_batch(examples, 4, MASK, PAD, "mars", prune=True))
    assert abs(sft - ref) < 1e-5 and abs(sft_ar - ref) < 1e-5 and sft_mask == 0
    assert abs(full[1] - ref) < 1e-5  # the clean stream never sees the noisy one (docs/method.md §4)
    assert abs(full[0] - ref) > 1e-2  # and a MARS batch's total loss is not it
    for a, b in zip(full, pruned):
        assert abs(a - b) < 1e-5


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    losses = mars_loss(model, batch, 0.5, **kw)
    losses[0].backward()
    return [x.item() for x in losses], grads(model)


@pytest.mark.parametrize("prune", [True, False])
def test_split_attention_equals_one_masked_call(prune):
    # Training runs the clean queries on the causal kernel and the noisy ones in a masked call of
    # their own (model.CausalPrefix); the reference is one call with the whole (T, T) mask.
    model = tiny_model(3, **LOSS_MODEL)
    batch = make_batch(random_examples(4, seed=11, n=6), 4, MASK, PAD, "mars", prune)
    with torch.no_grad():
        h_split = model.hidden(batch.tokens, batch.pos, train.CausalPrefix(batch.L, batch.noisy_mask()))
        h_one = model.hidden(batch.tokens, batch.pos, batch.mask)
    real = batch.valid  # pad columns may differ: they feed nothing
    assert (h_split - h_one)[real].abs().max() <= 1e-5
    (split, g_split), (one, g_one) = loss_and_grads(model, batch), loss_and_grads(model, batch, split=False)
    assert split == pytest.approx(one, abs=1e-5)
    assert g_split.keys() == g_one.keys() and len(g_one) == len(list(model.parameters()))
    for n in g_one:
        assert (g_split[n] - g_one[n]).abs().max() <= 1e-5, n


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_cross_entropy_equals_unchunked(chunk):
    # The head and CE over `chunk` targets at a time, recomputed in the backward: the same losses
    # and gradients as one piece, for a chunk smaller than, not dividing, and larger than S.
    for tied in (True, False):
        model = tiny_model(4, **LOSS_MODEL, tie_word_embeddings=tied)
        for mode in ("ar", "mars"):
            batch = make_batch(random_examples(4, seed=5, n=4), 4, MASK, PAD, mode)
            assert int((batch.labels != -100).sum()) > chunk or chunk == 64
            (ref, g_ref), (got, g_got) = loss_and_grads(model, batch), loss_and_grads(model, batch, chunk=chunk)
            assert got == pytest.approx(ref, abs=1e-5)
            for n in g_ref:
                assert (g_got[n] - g_ref[n]).abs().max() <= 1e-5, (n, tied, mode)


def test_chunked_cross_entropy_bounds_the_logits():
    # Peak logits: with chunking, no tensor of (more than chunk) x V values is ever made, in the
    # forward or in the backward; without it, the whole (S, V) logits are made and kept.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                # (rows, V) values made by an op, not views (such as the head weight's transpose)
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == 100 and not func.is_view:
                    Largest.rows = max(Largest.rows, t.shape[0])
            return out

    model = tiny_model(5, **LOSS_MODEL)
    batch = make_batch(random_examples(4, seed=6, n=6), 4, MASK, PAD, "mars")
    S = int((batch.labels != -100).sum())
    for chunk, bound in ((0, S), (16, 16)):
        Largest.rows = 0
        with Largest():
            mars_loss(model, batch, chunk=chunk)[0].backward()
        assert Largest.rows == bound and S > 16


def test_compiled_head_equals_the_eager_one():
    # --compile gives mars_loss head_ce compiled (the float32 upcast fused into the logsumexp): the same
    # losses and gradients for AR and MARS batches, chunk by chunk as training runs it (each chunk
    # recomputed under activation checkpointing), and the same losses without autograd (the held-out eval).
    compiled = torch.compile(train.head_ce, dynamic=True)
    model = tiny_model(4, **LOSS_MODEL)
    for mode in ("ar", "mars"):
        batch = make_batch(random_examples(4, seed=5, n=4), 4, MASK, PAD, mode)
        (ref, g_ref), (got, g_got) = loss_and_grads(model, batch, chunk=7), \
            loss_and_grads(model, batch, chunk=7, head=compiled)
        assert got == pytest.approx(ref, abs=1e-5) and ref[0] > 1.0
        assert g_got.keys() == g_ref.keys() and len(g_ref) == len(list(model.parameters()))
        for n in g_ref:
            assert (g_got[n] - g_ref[n]).abs().max() <= 1e-5, (n, mode)
        with torch.no_grad():
            evals = [mars_loss(model, batch, 0.5, 7, head=head) for head in (train.head_ce, compiled)]
        assert torch.allclose(torch.stack(evals[0]), torch.stack(evals[1]), atol=1e-5)


@pytest.mark.parametrize("cuda", [False, True])
def test_compiled_blocks_train_like_eager_on_batches_of_every_shape(cuda, monkeypatch):
    # --compile compiles each block for dynamic shapes (train.compile_blocks): a run's micro-batches differ in
    # rows, length and clean length, and a graph, made once, takes them all. The same losses and gradients as
    # eager, batch by batch, then without autograd (the held-out eval); a compile past dynamo's limit fails
    # rather than run eagerly. cuda: attention takes CUDA's path (model.attend), on the CPU.
    monkeypatch.setattr(model_module, "attend", partial(model_module.attend, cuda=cuda))
    torch._dynamo.reset()  # no earlier test's compiles count toward the limit
    graphs = counters["stats"]["unique_graphs"]
    model = tiny_model(3, **LOSS_MODEL)
    twin = copy.deepcopy(model)
    train.compile_blocks(twin)
    batches = [make_batch(random_examples(4, seed=11 + i, n=n), 4, MASK, PAD, "mars") for i, n in enumerate((6, 4, 8))]
    assert len({(b.tokens.shape, b.L) for b in batches}) == 3
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for batch in batches:
            (ref, g_ref), (got, g_got) = loss_and_grads(model, batch), loss_and_grads(twin, batch)
            assert got == pytest.approx(ref, abs=1e-5)
            assert g_got.keys() == g_ref.keys() and len(g_ref) == len(list(model.parameters()))
            for n in g_ref:
                assert (g_got[n] - g_ref[n]).abs().max() <= 1e-5, n
        with torch.no_grad():
            assert torch.allclose(torch.stack(mars_loss(model, batch)), torch.stack(mars_loss(twin, batch)), atol=1e-5)
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks ran compiled


def test_prefetch_collates_the_next_batch_while_this_one_runs():
    # The worker collates micro-batch k + 1 before the loop asks for it; batches come in order.
    import threading

    second_made = threading.Event()

    def make(i):
        if i == 1:
            second_made.set()
        return make_batch(random_examples(4, seed=i, n=2), 4, MASK, PAD)

    got = []
    for k, batch in enumerate(train.prefetch([0, 1, 2], make, torch.device("cpu"))):
        if k == 0:
            assert second_made.wait(timeout=30)  # made while batch 0 is still being used
        got.append(batch)
    assert len(got) == 3
    for i, batch in enumerate(got):
        ref = make_batch(random_examples(4, seed=i, n=2), 4, MASK, PAD)
        assert torch.equal(batch.tokens, ref.tokens) and torch.equal(batch.mask, ref.mask)


def test_lr_schedule():
    total, warmup, peak = 100, 3, 1e-3
    lrs = [lr_at(s, total, warmup, peak) for s in range(total)]
    assert lrs[:3] == pytest.approx([peak / 3, 2 * peak / 3, peak])
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # cosine decay after warmup
    assert lrs[-1] < 1e-3 * peak and lrs[-1] > 0
    assert lr_at(3 + 97 // 2, total, warmup, peak) == pytest.approx(peak / 2, rel=0.05)
    assert lr_at(0, 10, 0, peak) == peak
    # a --minutes budget: the decay follows the clock's share when it is further on than the steps
    assert lr_at(10, total, warmup, peak, clock=0.5) == pytest.approx(peak / 2)
    assert lr_at(10, total, warmup, peak, clock=1.2) == 0.0
    assert lr_at(90, total, warmup, peak, clock=0.1) == lr_at(90, total, warmup, peak)
    assert lr_at(1, total, warmup, peak, clock=0.9) == pytest.approx(2 * peak / 3)  # warmup is by steps


def test_warmup_ends_by_the_clock_too():
    # A step cap far beyond the budget would make a warmup of 3% of its steps outlast the run; under
    # --minutes the warmup also ends once its share of the budget has passed since the loop began (warm = 1),
    # rising with the clock until then.
    peak = 1e-3
    assert lr_at(10, 100_000, 3_000, peak, clock=0.05, warm=0.5) == pytest.approx(peak / 2)
    assert lr_at(10, 100_000, 3_000, peak, clock=0.05, warm=1.0) == pytest.approx(
        peak * 0.5 * (1 + math.cos(math.pi * 0.05)))
    assert lr_at(10, 100_000, 3_000, peak) == peak * 11 / 3000  # no budget: the steps alone


def test_offline_init_says_what_to_do(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    match = "--init qwen2.5-0.5b: .*Qwen/Qwen2.5-0.5B-Instruct.*Offline.*--init PATH"
    (tmp_path / "d.jsonl").write_text("")  # the data is there (train.py looks before --init loads)
    with pytest.raises(SystemExit, match=match) as e:
        train.main(["--init", "qwen2.5-0.5b", "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run"),
                    "--device", "cpu"])
    assert "\n" not in str(e.value)  # one line


# ---- the loop, on a tiny checkpoint and tiny data ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run_dir(tmp_path_factory.mktemp("tiny"), chats=48)


def encoded(tok: Tokenizer, file: Path) -> tuple[list, np.ndarray]:
    # The run's examples (max_len 512, B 4) and their lengths, read from the chat rows tiny_run_dir writes and
    # encoded as docs/method.md §1 says. The chats are short, none is dropped: an index here is one in the run.
    rows = [json.loads(line)["messages"] for line in file.read_text().splitlines()]
    examples = [fit_to_blocks(*tok.encode_chat_with_mask(m), 512, 4, tok.eos_id) for m in rows]
    return examples, np.array([len(ids) for ids, _ in examples])


def run(tiny, out, *flags):
    argv = ["--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"), "--out", str(out),
            "--device", "cpu", "--eval-fraction", "0", *flags]
    train.main(argv)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_both_losses(tiny, tmp_path):
    rows = run(tiny, tmp_path / "run", "--lr", "3e-3", "--batch-size", "8", "--global-batch", "8",
               "--max-steps", "30", "--save-every", "0", "--eval-every", "0")
    first, last = rows[0], rows[-1]
    assert len(rows) == 30 and [r["step"] for r in rows] == list(range(1, 31))
    assert set(first) >= {"step", "loss", "loss_ar", "loss_mask", "lr"}
    assert last["loss_ar"] < first["loss_ar"] - 1.5 and last["loss_mask"] < first["loss_mask"] - 1.5
    # the final model is a checkpoint directory that we and transformers both load
    model = Transformer.from_pretrained(tmp_path / "run", "cpu", torch.float32)
    Tokenizer.from_pretrained(tmp_path / "run")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32)
    x = torch.tensor([[1, 2, 3, 259]])
    assert torch.allclose(hf(x).logits, model(x), atol=1e-5)


def test_first_row_is_the_loss_of_the_first_example(tiny, tmp_path, capsys):
    # --lr 0: the model never changes (the run warns of it), and a row's losses are those of its batch before the
    # update.
    rows = run(tiny, tmp_path / "run", "--lr", "0", "--max-steps", "1", "--batch-size", "1",
               "--global-batch", "1", "--eval-every", "0", "--ar-weight", "0.5")
    assert "warning: --lr 0: the weights never change" in capsys.readouterr().out
    tok = Tokenizer.byte_level()
    examples, lengths = encoded(tok, tiny / "train.jsonl")
    first = step_batches(lengths, 1, 42, 0)[0][0]
    model = Transformer.from_pretrained(tiny / "init", "cpu", torch.float32)
    with torch.no_grad():
        batch = make_batch([examples[first]], 4, tok.mask_id, tok.pad_id)
        loss, loss_ar, loss_mask = mars_loss(model, batch, 0.5)
    assert rows[0]["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert rows[0]["loss_ar"] == pytest.approx(loss_ar.item(), abs=1e-5)
    assert rows[0]["loss_mask"] == pytest.approx(loss_mask.item(), abs=1e-5)


def test_accumulated_step_is_the_mean_over_the_global_batch(tiny, tmp_path):
    # 2 micro-batches of 2: the row's loss and gradient norm are those of one batch of all 4
    # sequences, each sequence weighted equally (docs/method.md §4), whatever their lengths.
    rows = run(tiny, tmp_path / "run", "--lr", "0", "--max-steps", "1", "--batch-size", "2",
               "--global-batch", "4", "--eval-every", "0", "--grad-clip", "1e9")
    tok = Tokenizer.byte_level()
    examples, lengths = encoded(tok, tiny / "train.jsonl")
    step = step_batches(lengths, 4, 42, 0)[0]
    model = Transformer.from_pretrained(tiny / "init", "cpu", torch.float32)
    loss, loss_ar, loss_mask = mars_loss(model, make_batch([examples[i] for i in step], 4, tok.mask_id,
                                                           tok.pad_id))
    loss.backward()
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert rows[0]["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)


def test_the_screen_keeps_a_few_step_lines_and_metrics_keeps_every_step(tiny, tmp_path, capsys, monkeypatch):
    # --epochs 1 at --global-batch 16: 48 examples make 3 steps, a run too short to learn, which is
    # named with the flag to change; --quiet prints no settings, versions, model or data summary.
    rows = run(tiny, tmp_path / "a", "--batch-size", "8", "--global-batch", "16", "--epochs", "1",
               "--eval-every", "0", "--log-every", "2", "--quiet")
    out = capsys.readouterr().out
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step")] == ["step 2/3", "step 3/3"]
    assert "warning: 48 examples make 3 steps per epoch of --global-batch 16, 3 optimizer steps in all: " \
           "lower --global-batch" in out
    assert '"init"' not in out and "model:" not in out and "training examples" not in out and "attention:" not in out
    # On a terminal every step is drawn in place, and the kept ones stay: one line for a run of
    # --log-every steps. --max-steps sets the length: no warning.
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    run(tiny, tmp_path / "b", "--batch-size", "8", "--global-batch", "16", "--max-steps", "3", "--eval-every", "0",
        "--log-every", "3")
    out = capsys.readouterr().out
    drawn = [part.split(" |")[0] for part in out.split("\r\x1b[K")[1:]]
    assert drawn == ["step 1/3", "step 2/3", "step 3/3"]
    assert [line.split(" |")[0] for line in out.split("\r\x1b[K")[-1].splitlines()][:3] == [
        "step 3/3", f"saved {tmp_path / 'b' / 'checkpoints' / 'step-000003'}", f"saved {tmp_path / 'b'}"]
    assert out.count("\r\x1b[Kstep 3/3") == 1 and "\n" not in out.split("\r\x1b[K")[1] and "warning" not in out
    assert '"init"' in out  # without --quiet, the settings
    # and once, the versions of torch (CUDA, cuDNN) and the attention kernels each SDPA call may use
    assert out.count("attention: torch ") == 1


def strip(rows):  # wall-clock fields differ between runs
    return [{k: v for k, v in r.items() if k != "dt"} for r in rows]


def test_resume_repeats_the_unbroken_run(tiny, tmp_path, monkeypatch, capsys):
    flags = ["--lr", "3e-3", "--batch-size", "4", "--global-batch", "8", "--max-steps", "8",
             "--save-every", "2", "--keep", "2", "--eval-every", "3", "--eval-fraction", "0.2",
             "--warmup", "0.25"]
    unbroken = run(tiny, tmp_path / "a", *flags)
    assert sum("eval_loss" in r for r in unbroken) == 4  # before step 1, after 3, 6 and 8

    real_lr_at = train.lr_at

    def crash_at_step_6(step, *args):  # dies after step 5's row, past the step-4 checkpoint
        if step == 5:
            raise KeyboardInterrupt
        return real_lr_at(step, *args)

    monkeypatch.setattr(train, "lr_at", crash_at_step_6)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # Ctrl-C: one line that says where the run goes on from, status 130
        run(tiny, tmp_path / "b", *flags)
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == f"interrupted: --resume goes on from {tmp_path}/b/checkpoints/step-000004"
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000004"]
    with pytest.raises(SystemExit, match="already holds a run"):
        run(tiny, tmp_path / "b", *flags)
    capsys.readouterr()
    # --out alone resumes: the flags not given are the run's own (its checkpoint's settings.json); one given
    # that differs is said, with both values
    train.main(["--out", str(tmp_path / "b"), "--resume", "--log-every", "1"])
    assert "warning: flags that differ from the checkpoint's: --log-every 0 -> 1\n" in capsys.readouterr().out
    resumed = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert strip(resumed) == strip(unbroken)
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert ckpts == ["step-000006", "step-000008"]  # --keep 2; the last step's too
    a = Transformer.from_pretrained(tmp_path / "a", "cpu").state_dict()
    b = Transformer.from_pretrained(tmp_path / "b", "cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_while_caching_the_tokenized_data_is_one_line_and_leaves_no_partial_cache(tiny, tmp_path,
                                                                                             monkeypatch):
    real_save = np.save

    def save_then_full(file, array):  # the first array written, then the disk is full
        if Path(file).name != "ids.npy":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(file, array)

    monkeypatch.setattr(np, "save", save_then_full)  # numpy's own: the cache's writer (mars/examples.py) calls it
    rows = tmp_path / "data" / "train.jsonl"
    rows.parent.mkdir()
    shutil.copy(tiny / "train.jsonl", rows)
    with pytest.raises(SystemExit) as e:
        train.main(["--init", str(tiny / "init"), "--data", str(rows), "--out", str(tmp_path / "run"),
                    "--device", "cpu", "--max-steps", "1", "--batch-size", "4", "--global-batch", "4"])
    cache = rows.parent / ".mars-cache"
    assert str(e.value).startswith(f"error: no space left on {cache} to write train.jsonl-")
    assert str(e.value).endswith("free some space there: the tokenized data is cached beside the data files")
    assert list(cache.iterdir()) == []  # neither the cache nor its temporary folder


def test_two_processes_equal_one(tiny, tmp_path):
    # Same global batch (8): 1 process x 2 sequences x 4 micro-batches, and 2 processes x 2 x 2.
    # lr is large, so step 2 shows whether step 1's gradients were averaged over both processes.
    # The two processes run under an hour's --minutes, which never binds here: they agree on the clock's
    # share and on when to stop by one collective a step.
    common = ["--lr", "1e-2", "--batch-size", "2", "--global-batch", "8", "--max-steps", "2",
              "--save-every", "0", "--eval-every", "1", "--eval-fraction", "0.2"]
    one = run(tiny, tmp_path / "one", *common)
    argv = ["--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"), "--out",
            str(tmp_path / "two"), "--device", "cpu", *common, "--minutes", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(ROOT / "train.py"), *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(one) == len(two) == 5  # eval, step 1, eval, step 2, eval
    for r1, r2 in zip(strip(one), strip(two)):
        assert r1.keys() == r2.keys()
        for k in r1:
            assert r1[k] == pytest.approx(r2[k], abs=1e-5), (k, r1, r2)


def test_global_batch_fixes_grad_accumulation():
    assert train.grad_accum_for(384, 16, 1) == 24
    assert train.grad_accum_for(384, 16, 8) == 3  # torchrun on 8 GPUs: still 384 sequences per step
    with pytest.raises(ValueError, match=r"--global-batch 384 is not a multiple of --batch-size 10 x 8 "
                                         r"processes = 80; use --batch-size 8 or 6 or 4"):
        train.grad_accum_for(384, 10, 8)
    with pytest.raises(ValueError, match=r"processes = 80; use a --global-batch that is a multiple of 80 \(no batch "
                                         r"size divides 384 over 5 processes\)"):
        train.grad_accum_for(384, 16, 5)


def test_data_is_required_unless_tiny(capsys):
    with pytest.raises(SystemExit) as e:  # a usage error
        train.parse_settings(["--init", "qwen2.5-0.5b"])
    assert e.value.code == 2
    assert re.search("--init qwen2.5-0.5b needs --data.*allenai/Dolci-Instruct-SFT", capsys.readouterr().err)
    assert train.parse_settings([]).data == "data/demo/train.jsonl"  # the tiny demo's own data
    assert train.parse_settings(["--init", "x/y", "--data", "d.jsonl"]).data == "d.jsonl"


def test_checkpoints_keep_the_init_dtype_and_resume_exactly(tiny, tmp_path, monkeypatch):
    # A bf16 init (as Qwen releases are) is saved back in bf16 with torch_dtype bfloat16, and
    # transformers loads it as such. Training weights stay float32: a resumed run continues from
    # the float32 master weights kept in train_state.pt, so it repeats the unbroken run exactly.
    init = tmp_path / "init-bf16"
    Transformer.from_pretrained(tiny / "init", "cpu", torch.float32).save_pretrained(init, dtype=torch.bfloat16)
    Tokenizer.byte_level().save_pretrained(init)
    argv = lambda out, *f: ["--init", str(init), "--data", str(tiny / "train.jsonl"), "--out", str(out),  # noqa: E731
                            "--device", "cpu", "--eval-fraction", "0", "--eval-every", "0", "--lr", "3e-3",
                            "--batch-size", "4", "--global-batch", "8", "--max-steps", "4", "--save-every", "2", *f]
    train.main(argv(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    from safetensors.torch import load_file
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "a" / "model.safetensors").values())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert hf.dtype == torch.bfloat16
    ours = Transformer.from_pretrained(tmp_path / "a", "cpu")
    x = torch.tensor([[1, 2, 3, 259]])
    with torch.no_grad():
        ref = ours.float()(x)
        assert (hf.float()(x).logits - ref).abs().max() <= 1e-4  # the same bf16 weights

    real_lr_at = train.lr_at

    def crash(step, *args):  # dies in step 3, after the step-2 checkpoint
        if step == 2:
            raise KeyboardInterrupt
        return real_lr_at(step, *args)

    monkeypatch.setattr(train, "lr_at", crash)
    with pytest.raises(SystemExit, match="^130$"):  # Ctrl-C
        train.main(argv(tmp_path / "b"))
    monkeypatch.setattr(train, "lr_at", real_lr_at)
    state = torch.load(tmp_path / "b" / "checkpoints" / "step-000002" / "train_state.pt", weights_only=True)
    assert state["model"]["model.norm.weight"].dtype == torch.float32
    train.main(argv(tmp_path / "b", "--resume"))
    rows = lambda run: strip(json.loads(r) for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines())  # noqa: E731
    assert rows("a") == rows("b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    train.main(argv(tmp_path / "c", "--save-dtype", "float32", "--max-steps", "1"))
    assert json.loads((tmp_path / "c" / "config.json").read_text())["torch_dtype"] == "float32"


def torchrun(*argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "train.py"), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fsdp_equals_one_process_and_resumes(tiny, tmp_path):
    # --fsdp on 2 processes (gloo): parameters, gradients and AdamW state sharded. The same global
    # batch of 8 as one process: the same losses, eval losses (5 held-out batches: one process
    # runs a weightless extra forward) and updated weights. Then a resume from its step-1
    # checkpoint, still sharded, repeats step 2. The sharded run saves bfloat16, as a 7B run from Qwen's
    # weights does: its checkpoints hold the float32 weights beside the saved ones, and the resume loads them.
    from safetensors.torch import load_file

    common = ["--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"), "--device", "cpu",
              "--lr", "1e-2", "--batch-size", "2", "--global-batch", "8", "--max-steps", "2",
              "--save-every", "1", "--eval-every", "1", "--eval-fraction", "0.2"]
    train.main([*common, "--out", str(tmp_path / "one")])
    torchrun(*common, "--out", str(tmp_path / "two"), "--fsdp", "--save-dtype", "bfloat16")
    rows = lambda run: strip(json.loads(r) for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines())  # noqa: E731
    one, two = rows("one"), rows("two")
    assert len(one) == len(two) == 5  # eval, step 1, eval, step 2, eval
    for r1, r2 in zip(one, two):
        assert r1.keys() == r2.keys()
        for k in r1:
            assert r1[k] == pytest.approx(r2[k], abs=1e-5), (k, r1, r2)
    w1 = load_file(tmp_path / "one" / "model.safetensors")
    masters = lambda run, step: torch.load(tmp_path / run / "checkpoints" / f"step-00000{step}" / "train_state.pt",  # noqa: E731
                                           weights_only=True)["model"]
    w2 = masters("two", 2)
    assert w1.keys() == w2.keys()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-5
    assert max((w1[k] - load_file(tiny / "init" / "model.safetensors")[k]).abs().max().item() for k in w1) > 1e-3
    saved = load_file(tmp_path / "two" / "model.safetensors")
    assert all(saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], w2[k].bfloat16()) for k in w2)

    (tmp_path / "three").mkdir()  # a run killed after its step-1 checkpoint
    step_1 = Path("checkpoints") / "step-000001"
    shutil.copytree(tmp_path / "two" / step_1, tmp_path / "three" / step_1)
    shutil.copy(tmp_path / "two" / "metrics.jsonl", tmp_path / "three")
    torchrun(*common, "--out", str(tmp_path / "three"), "--fsdp", "--save-dtype", "bfloat16", "--resume")
    assert rows("three") == two
    w3 = masters("three", 2)
    assert max((w2[k] - w3[k]).abs().max().item() for k in w2) <= 1e-6


def test_resume_refuses_what_would_lose_or_change_a_run(tiny, tmp_path):
    flags = ["--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--eval-every", "0"]
    # A finished run with no step checkpoint: --resume would train again from --init over its model.
    done = tmp_path / "done"
    run(tiny, done, *flags, "--max-steps", "2", "--save-every", "0")
    model = (done / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match=r"holds a finished model and no step checkpoint to resume from: --resume "
                                         r"would train again from --init and replace it"):
        run(tiny, done, *flags, "--max-steps", "4", "--save-every", "0", "--resume")
    assert (done / "model.safetensors").read_bytes() == model
    # Other data under the same checkpoint: the split and the order would change, so it is refused.
    out = tmp_path / "a"
    run(tiny, out, *flags, "--max-steps", "6", "--save-every", "2", "--keep", "2")  # checkpoints 4 and 6
    more = tmp_path / "more.jsonl"
    more.write_text((tiny / "train.jsonl").read_text() * 2)
    argv = ["--init", str(tiny / "init"), "--data", str(more), "--out", str(out), "--device", "cpu",
            "--eval-fraction", "0", *flags, "--max-steps", "8", "--save-every", "2", "--keep", "2", "--resume"]
    with pytest.raises(SystemExit, match=r"step-000006: the data changed since this checkpoint \(48 training and 0 "
                                         r"held-out examples then, 96 and 0 now, lengths different\)"):
        train.main(argv)
    # The same data, now with evals on and another --eval-fraction: the held-out split would change; the message
    # names the flags (--seed, which the split does not follow, is not among them).
    with pytest.raises(SystemExit, match=r"step-000006: --eval-fraction, --eval-every changed, which the "
                                         r"held-out split follows, since this checkpoint"):
        run(tiny, out, "--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--eval-every", "2",
            "--eval-fraction", "0.1", "--max-steps", "8", "--save-every", "2", "--keep", "2", "--seed", "7", "--resume")
    # A flag that changes what the run trains (here its block size) would carry on another run's optimizer.
    with pytest.raises(SystemExit, match=r"step-000006: trained with --block-size 4, resumed with --block-size 8, "
                                         r"which changes what the run trains; resume with the run's own flags"):
        run(tiny, out, *flags, "--max-steps", "8", "--save-every", "2", "--keep", "2", "--block-size", "8", "--resume")
    # A damaged newest checkpoint is named, with the one the run would go on from without it.
    state = out / "checkpoints" / "step-000006" / "train_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(SystemExit, match=r"step-000006: this checkpoint cannot be read \(.*\); a damaged disk or "
                                         r"copy. Delete it and --resume goes on from step-000004"):
        run(tiny, out, *flags, "--max-steps", "8", "--save-every", "2", "--keep", "2", "--resume")


def test_a_checkpoint_with_the_settings_of_removed_features_resumes_only_at_their_defaults(tiny, tmp_path):
    # A checkpoint's settings.json may name the teacher, per-slot mask vectors or calibration, all removed
    # (docs/method.md §16): at the values every run now trains with it resumes, at others it is refused in
    # one line, before any row is cut.
    flags = ["--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--eval-every", "0", "--save-every", "2"]
    out = tmp_path / "a"
    run(tiny, out, *flags, "--max-steps", "4")
    file = out / "checkpoints" / "step-000004" / "settings.json"  # the newest
    saved = json.loads(file.read_text())
    assert not {"teacher", "mask_embed", "calibrate"} & set(saved)
    for removed, value in (("teacher", "init"), ("mask_embed", "per-slot")):
        file.write_text(json.dumps({**saved, "teacher": "none", "mask_embed": "one", removed: value}))
        flag = f"--{removed.replace('_', '-')} {value}"
        with pytest.raises(SystemExit, match=rf"step-000004: trained with {flag}, which this code no longer has "
                                             r"\(docs/method.md §16\); resume it with the code that trained it") as e:
            run(tiny, out, *flags, "--max-steps", "6", "--resume")
        assert "\n" not in str(e.value)
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4]
    file.write_text(json.dumps({**saved, "teacher": "none", "mask_embed": "one", "calibrate": 64}))
    rows = run(tiny, out, *flags, "--max-steps", "6", "--resume")
    assert [r["step"] for r in rows] == list(range(1, 7))


def test_resume_drops_a_metrics_row_cut_short(tiny, tmp_path, capsys):
    # A kill or a full disk mid-row leaves half a line last: the resume drops it, says so, and goes on.
    flags = ["--lr", "3e-3", "--batch-size", "8", "--global-batch", "8", "--eval-every", "0", "--save-every", "2",
             "--keep", "2"]
    out = tmp_path / "a"
    rows = run(tiny, out, *flags, "--max-steps", "4")
    shutil.rmtree(out / "checkpoints" / "step-000004")  # killed before its last checkpoint: it goes on from step 2
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    resumed = run(tiny, out, *flags, "--max-steps", "4", "--resume")
    assert "metrics.jsonl:5: the last row was cut short (a kill or a full disk); dropped" in capsys.readouterr().out
    assert strip(resumed) == strip(rows)
