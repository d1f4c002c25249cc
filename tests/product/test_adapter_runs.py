# What surrounds the gated mask adapter and self-distilled targets (docs/method.md §10): the soft
# cross-entropy of mars/keep_base.py, an adapter run's files, its resume and the flags it refuses, its
# checkpoint on disk, and the cost curve of its decoding forwards.
import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train
from conftest import LOSS_MODEL, random_examples, tiny_model, tiny_run_dir
from data import make_batch
from mars import adapter, keep_base
from mars.checkpoint import check_checkpoint, load_model, same_base, warn_untrained_masks
from train import loss_variant, mars_loss

MASK, PAD = 99, 98  # LOSS_MODEL's 100 ids: the mask is 99


def adapted(seed: int = 0, scale: float = 0.0):
    # (base, the same weights with an adapter), the adapter random at `scale` (0: a fresh one, B = 0).
    base, model = tiny_model(seed, **LOSS_MODEL), tiny_model(seed, **LOSS_MODEL)
    ad = adapter.attach(model, MASK, rank=4, alpha=8.0)
    if scale:
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            for p in ad.parameters():
                p.copy_(scale * torch.randn_like(p))
    return base, model.eval()


def run(tiny, out, *flags):
    argv = ["--init", str(tiny / "init"), "--data", str(tiny / "train.jsonl"), "--out", str(out),
            "--device", "cpu", "--eval-fraction", "0", *flags]
    train.main(argv)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_soft_loss_with_one_hot_targets_is_the_hard_loss():
    torch.manual_seed(0)
    logits, y = torch.randn(7, 11), torch.randint(0, 11, (7,))
    one_hot = torch.full((7, 11), float("-inf")).scatter(1, y[:, None], 0.0)  # softmax: exactly one-hot
    assert torch.allclose(keep_base.soft_ce(logits, one_hot), F.cross_entropy(logits, y, reduction="none"), atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 3])
def test_no_gradient_reaches_the_targets(chunk):
    model = tiny_model(0, **LOSS_MODEL)
    h, t = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    train.chunked(partial(keep_base.distill_ce, model), chunk, h, t).sum().backward()  # as mars_loss chunks it
    assert h.grad.abs().sum() > 0 and t.grad is None
    # inside the loss the self targets are the clean stream, detached: only loss_ar's gradient flows there
    batch = make_batch(random_examples(4, seed=2), 4, MASK, PAD)
    clean_only = tiny_model(0, **LOSS_MODEL)
    mars_loss(clean_only, batch, ar_weight=0.0, variant=loss_variant("self"))[0].backward()
    embed = clean_only.model.embed_tokens.weight.grad
    assert embed is not None and embed[MASK].abs().sum() > 0  # the noisy stream learns


def run_adapter(tiny, out, *flags):
    # data targets: a random model's own distribution is near uniform, so self targets barely move here
    return run(tiny, out, "--adapter", "gated-lora", "--lora-rank", "4", "--mask-target", "data", "--lr", "1e-2",
               "--batch-size", "4", "--global-batch", "8", "--eval-every", "0", *flags)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run_dir(tmp_path_factory.mktemp("tiny"), chats=32, system=False)


def test_an_adapter_run_saves_the_adapter_alone_and_loads_with_ckpt(tiny, tmp_path, capsys):
    rows = run_adapter(tiny, tmp_path / "run", "--max-steps", "6", "--save-every", "3")
    assert rows[-1]["loss_mask"] < rows[0]["loss_mask"]  # the masks learn
    assert max(r["loss_ar"] for r in rows) - min(r["loss_ar"] for r in rows) < 0.5  # the base's loss, per batch
    run = tmp_path / "run"
    # the adapter, its config and the tokenizer: no config.json, so nothing loads it as a plain model
    names = {p.name for p in run.iterdir()}
    assert {"adapter.safetensors", adapter.CONFIG, "tokenizer.json", "settings.json"} <= names
    assert "config.json" not in names and "adapter_config.json" not in names and "model.safetensors" not in names
    assert json.loads((run / adapter.CONFIG).read_text())["base"] == str((tiny / "init").resolve())
    from transformers import AutoModelForCausalLM

    with pytest.raises((OSError, ValueError)):  # transformers finds no model config: nothing loads
        AutoModelForCausalLM.from_pretrained(run)
    # the frozen base has no AdamW state: the checkpoint's optimizer holds the adapter's tensors only
    state = torch.load(run / "checkpoints" / "step-000003" / "train_state.pt", weights_only=True)
    assert set(state) >= {"optimizer"} and "model" not in state
    assert all(k.startswith("adapter.") for k in state["optimizer"]["state"])
    # --ckpt loads it gated, on its base, and the outputs round-trip
    path, config = check_checkpoint(str(run))
    model, base = load_model(path, "cpu", torch.float32), load_model(tiny / "init", "cpu", torch.float32)
    assert config.hidden_size == base.config.hidden_size
    assert not warn_untrained_masks(path, 0.9)  # an adapter run is MARS-trained
    tok_mask = model.adapter.mask_id
    x = torch.tensor([[5, 6, 7, 8, tok_mask, tok_mask, tok_mask]])
    with torch.no_grad():
        got, ref = model(x), base(x)
    assert torch.equal(got[:, :4], ref[:, :4]) and not torch.allclose(got[:, 4:], ref[:, 4:])
    assert model.adapter.B["model/layers/1/mlp/down_proj"].abs().sum() > 0  # the trained weights, not a fresh adapter


def test_an_adapter_run_resumes_like_an_unbroken_one(tiny, tmp_path, monkeypatch):
    flags = ("--max-steps", "4", "--save-every", "2")
    unbroken = run_adapter(tiny, tmp_path / "a", *flags)
    calls = {"n": 0}
    real = train.mars_loss

    def dying(*a, **k):  # the run dies in its third step, after the step-2 checkpoint
        calls["n"] += 1
        if calls["n"] > 2 * 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train, "mars_loss", dying)
    with pytest.raises(SystemExit, match="^130$"):  # Ctrl-C
        run_adapter(tiny, tmp_path / "b", *flags)
    monkeypatch.setattr(train, "mars_loss", real)
    resumed = run_adapter(tiny, tmp_path / "b", *flags, "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in unbroken], abs=1e-6)


def test_an_adapter_run_resumes_on_its_own_base_only(tiny, tmp_path, monkeypatch):
    # The frozen base is the run's: another --init on --resume would be named as the base by the saves after it.
    run_adapter(tiny, tmp_path / "run", "--max-steps", "1")
    other = tmp_path / "other"
    shutil.copytree(tiny / "init", other)
    with pytest.raises(SystemExit, match=rf"an adapter on the frozen base {(tiny / 'init').resolve()}, resumed with "
                       rf"--init {other}, which its saves would name as its base; resume with --init "):
        run_adapter(tiny, tmp_path / "run", "--max-steps", "2", "--resume", "--init", str(other))
    monkeypatch.chdir(tiny)  # the same folder by another path trains on
    rows = run_adapter(tiny, tmp_path / "run", "--max-steps", "2", "--resume", "--init", "init")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert adapter.base_path(tmp_path / "run") == str((tiny / "init").resolve())
    monkeypatch.setattr(adapter, "base_path", lambda path: "Qwen/Qwen2.5-0.5B-Instruct")  # a hub base: its alias
    assert same_base(tmp_path / "run", "qwen2.5-0.5b") and not same_base(tmp_path / "run", "qwen2.5-7b")


def test_an_adapter_run_as_init_names_its_base_and_resume(tiny, tmp_path):
    # An adapter run has no config.json: --init of one says what it is and the two ways on, not "config.json
    # not found" as if the checkpoint were broken.
    run_adapter(tiny, tmp_path / "run", "--max-steps", "1")
    with pytest.raises(SystemExit) as e:
        run_adapter(tiny, tmp_path / "next", "--max-steps", "1", "--init", str(tmp_path / "run"))
    base, run = (tiny / "init").resolve(), tmp_path / "run"
    assert str(e.value) == (f"error: --init {run}: an adapter run ({adapter.CONFIG}), not a model to start from: a "
                            f"new adapter starts from its base, --init {base}; the run itself trains on with the flags "
                            f"it was started with and --resume (--init {base} --out {run})")
    # ... which is what goes on from its last step checkpoint; one saved without any says so
    rows = run_adapter(tiny, run, "--max-steps", "2", "--resume")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    run_adapter(tiny, tmp_path / "once", "--max-steps", "1", "--save-every", "0")
    with pytest.raises(SystemExit, match="An adapter trains on only from a step checkpoint: start a new adapter run"):
        run_adapter(tiny, tmp_path / "once", "--max-steps", "2", "--save-every", "0", "--resume")
    # A run killed before its final save holds adapter step checkpoints alone: none of them is an --init either.
    for f in run.iterdir():
        if f.is_file() and f.name != "metrics.jsonl":
            f.unlink()
    with pytest.raises(SystemExit, match=rf"--init {run}: an adapter run with no final save yet \(killed, or still "
                                         rf"running\), and an adapter run is no --init: finish it with python "
                                         rf"train.py --out {run} --resume"):
        run_adapter(tiny, tmp_path / "next", "--max-steps", "1", "--init", str(run))


def test_bench_times_an_adapter_run_against_transformers_on_its_base(tiny, tmp_path, monkeypatch):
    # tools.bench's outside baseline is transformers' greedy generate: for an adapter run, on its base, whose
    # tokens the run's AR decoding gives (the run's folder holds no model transformers could load).
    from tools import bench

    run_adapter(tiny, tmp_path / "run", "--max-steps", "1")
    loaded, runner = [], bench.hf_runner
    monkeypatch.setattr(bench, "hf_runner", lambda s, path, *a: loaded.append(path) or runner(s, path, *a))
    bench.main(["--ckpt", str(tmp_path / "run"), "--reps", "1", "--batch-sizes", "2", "--thresholds", "0.9",
                "--max-new-tokens", "6", "--no-verify", "--device", "cpu", "--dtype", "float32",
                "--json", str(tmp_path / "b.json")])
    rows = {r["method"]: r for r in json.loads((tmp_path / "b.json").read_text())["results"]}
    assert loaded == [(tiny / "init").resolve()]
    assert rows["transformers generate"]["new_tokens"] == rows["AR + KV cache"]["new_tokens"] > 0


def test_an_adapter_whose_base_is_an_adapter_is_refused(tmp_path):
    # An adapter trains on a plain checkpoint: a base that is the run itself (relative or absolute) or
    # another adapter run in a cycle is one line naming the file, not a RecursionError or a path that
    # grows until the OS refuses it.
    def adapter_run(name: str, base: str) -> Path:
        (tmp_path / name).mkdir(exist_ok=True)
        config = {"type": "gated-lora", "base": base, "rank": 4, "alpha": 8.0, "mask_id": 259}
        (tmp_path / name / adapter.CONFIG).write_text(json.dumps(config))
        return tmp_path / name

    cases = [(adapter_run("self", "."), "this adapter run itself"),
             (adapter_run("self-abs", str(tmp_path / "self-abs")), "this adapter run itself"),
             (adapter_run("a", str(tmp_path / "b")), "an adapter run")]
    adapter_run("b", "../a")
    for run, which in cases:
        for load in (check_checkpoint, load_model):
            with pytest.raises(ValueError, match=f"{run / adapter.CONFIG}: its base .* is {which}, not a plain "
                                                 "checkpoint; set \"base\" to the checkpoint") as e:
                load(str(run))
            assert "\n" not in str(e.value)
    # A base that moved away: the file and the field to fix are named, not a path the user never typed.
    run = adapter_run("moved", str(tmp_path / "gone" / "base"))
    with pytest.raises(FileNotFoundError, match=f"{run / adapter.CONFIG}: its \"base\" .*gone/base: checkpoint "
                                                f"directory not found.*If the base checkpoint moved, set \"base\" in "
                                                f"{run / adapter.CONFIG} to its folder"):
        check_checkpoint(str(run))


def test_an_adapter_on_another_base_or_with_a_bad_config_is_one_line_naming_the_fix(tmp_path):
    # Its base edited to a wider model: one line naming the first tensor that differs and the field to set, not
    # torch's line per tensor (337 on the 0.5B).
    _, model = adapted(scale=0.1)
    adapter.save(model.adapter, tmp_path / "run", "base")
    wider = tiny_model(0, **{**LOSS_MODEL, "hidden_size": 64, "intermediate_size": 128})
    with pytest.raises(ValueError) as e:
        adapter.load(wider, tmp_path / "run")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'run' / adapter.WEIGHTS}: does not fit the base "
                                                      "model base: it holds ")
    assert "where rank 4 on this base needs" in message and message.endswith(
        f"set \"base\" in {tmp_path / 'run' / adapter.CONFIG} to the checkpoint the adapter was trained on")
    config = json.loads((tmp_path / "run" / adapter.CONFIG).read_text())
    (tmp_path / "run" / adapter.CONFIG).write_text(json.dumps({**config, "mask_id": 100}))  # LOSS_MODEL has 100 ids
    with pytest.raises(ValueError, match="mask_id 100 has no embedding row in the base model base \\(100 ids\\)"):
        adapter.load(tiny_model(0, **LOSS_MODEL), tmp_path / "run")
    for key, value in (("rank", "four"), ("rank", 0), ("alpha", None), ("mask_id", True)):
        (tmp_path / "run" / adapter.CONFIG).write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=f"{adapter.CONFIG}: {key} {value!r} must be a number of at least"):
            adapter.load(tiny_model(0, **LOSS_MODEL), tmp_path / "run")


def test_adapter_flags_that_cannot_work_are_refused(tiny, tmp_path, capsys):
    for flags in (["--mode", "ar"], ["--lora-rank", "0"]):
        with pytest.raises(SystemExit):
            run_adapter(tiny, tmp_path / "x", "--max-steps", "1", *flags)
    for alpha in ("-8", "0", "inf"):  # an adapter that would train and then not load, or not train
        with pytest.raises(SystemExit):
            run_adapter(tiny, tmp_path / "x", "--max-steps", "1", "--lora-alpha", alpha)
        assert f"--lora-alpha {float(alpha)} must be a number > 0" in capsys.readouterr().err


def test_an_adapter_saves_and_loads_and_one_with_a_vector_per_slot_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _, model = adapted(scale=0.5)
    adapter.save(model.adapter, tmp_path / "run", base="base")
    loaded = adapter.load(tiny_model(0, **LOSS_MODEL), tmp_path / "run")
    assert torch.equal(loaded.embed, model.adapter.embed) and torch.equal(loaded.B["model/layers/0/mlp/up_proj"],
                                                                          model.adapter.B["model/layers/0/mlp/up_proj"])
    # A file that holds the offset as one row per slot, with "slots": 1 in its config, loads the same.
    state = load_file(tmp_path / "run" / adapter.WEIGHTS)
    state["embed"] = state["embed"][None]
    save_file(state, tmp_path / "run" / adapter.WEIGHTS)
    config = json.loads((tmp_path / "run" / adapter.CONFIG).read_text())
    (tmp_path / "run" / adapter.CONFIG).write_text(json.dumps({**config, "slots": 1}))
    assert torch.equal(adapter.load(tiny_model(0, **LOSS_MODEL), tmp_path / "run").embed, model.adapter.embed)
    # One with a mask vector per slot is refused in one line, before its weights are read.
    state["embed"] = state["embed"].expand(4, -1).contiguous()
    save_file(state, tmp_path / "run" / adapter.WEIGHTS)
    (tmp_path / "run" / adapter.CONFIG).write_text(json.dumps({**config, "slots": 4}))
    for load in (lambda: adapter.load(tiny_model(0, **LOSS_MODEL), tmp_path / "run"),
                 lambda: check_checkpoint(str(tmp_path / "run"))):
        with pytest.raises(ValueError) as e:
            load()
        assert str(e.value).startswith(f"{tmp_path / 'run' / adapter.CONFIG}: slots 4: this adapter has a mask "
                                       "vector per slot") and "retrain it with one mask vector" in str(e.value)
        assert "\n" not in str(e.value)


def test_the_cost_curve_of_an_adapter_feeds_masks_so_its_hooks_are_timed(monkeypatch):
    from mars import budget
    _, model = adapted(scale=0.5)
    calls = []
    real = model.adapter.updates
    monkeypatch.setattr(model.adapter, "updates",
                        lambda names, x: calls.append(len(model.adapter.at)) or real(names, x))
    seconds = budget.measure(model, 2, [1, 4], context=8, reps=1)
    assert len(seconds) == 2 and min(seconds) > 0
    # n = 1 is one token and no mask: no update; n = 4 is a token and 3 masks per row: 6 mask rows, in
    # the 4 input groups of every layer, in the warm-up and the timed forward
    assert calls == [6] * (4 * model.config.num_hidden_layers * 2)
