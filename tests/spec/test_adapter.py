# The gated mask adapter (adapter.py) and self-distilled mask targets (docs/method.md §10), in float32
# on tiny random models: clean positions compute the base model bit for bit, decoding keeps the base's
# greedy tokens in every cache mode, the two-pass adapter loss is the MARS loss, and the soft targets
# behave as a loss should.
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_train import LOSS_MODEL, MASK, PAD, random_examples

from conftest import tiny_model, tiny_run_dir
from data import make_batch
from generate import Options, decode
from mars import adapter, keep_base
from mars.checkpoint import check_checkpoint, load_model, warn_untrained_masks
from mars.keep_base import adapter_loss, distill_ce, distilled_loss, soft_ce
from train import mars_loss


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


def test_every_non_mask_logit_is_the_base_models_bit_for_bit():
    base, model = adapted(scale=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 90, (3, 24), generator=g)
    x[0, 20:], x[1, 9:], x[2, 23] = MASK, MASK, MASK  # masks after a prefix, as decoding appends them
    with torch.no_grad():
        got, ref = model(x), base(x)
    clean = x != MASK  # under the causal rule no clean position here follows a mask
    assert torch.equal(got[clean], ref[clean])  # bit for bit, not allclose
    assert not torch.allclose(got[~clean], ref[~clean], atol=1e-3)  # the masks did change
    # The MARS training layout too: clean stream, then a noisy stream under its block mask, where
    # clean tokens inside the noisy blocks (a prompt's tail) sit among masks but never read them.
    batch = make_batch(random_examples(4, seed=3), 4, MASK, PAD)
    with torch.no_grad():
        h, h_ref = model.hidden(batch.tokens, batch.pos, batch.mask), base.hidden(batch.tokens, batch.pos, batch.mask)
    clean = torch.zeros_like(batch.tokens, dtype=torch.bool)
    clean[:, :batch.L] = True
    assert torch.equal(h[clean], h_ref[clean])
    assert not torch.allclose(h[batch.tokens == MASK], h_ref[batch.tokens == MASK], atol=1e-3)


def test_a_forward_of_mostly_masks_updates_every_row_and_keeps_every_clean_one_bit_for_bit():
    # A decode step feeds a few tokens, then masks: the adapter then updates every row and selects, rather
    # than gathering the mask rows and scattering back. Both give the same drafts and the base's clean rows.
    base, model = adapted(scale=0.5)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 90, (1, 24), generator=g)
    x[0, 4:] = MASK  # 20 of 24 positions
    with torch.no_grad():
        got, ref = model(x), base(x)
        assert model.adapter.dense
        wide = model(torch.cat([x, torch.randint(0, 90, (3, 24), generator=g)]))  # 20 of 96: gathered
        assert not model.adapter.dense
    clean = x != MASK
    assert torch.equal(got[clean], ref[clean])
    assert not torch.allclose(got[~clean], ref[~clean], atol=1e-3)
    assert torch.allclose(got, wide[:1], atol=1e-5, rtol=1e-5)


def test_a_bf16_model_decodes_its_updates_in_float32_and_keeps_every_clean_row_bit_for_bit():
    # Decoding runs the low-rank products in float32 and adds them into the bf16 output in place, zero off
    # the masks: clean rows must still be the bf16 base's, in a forward of mostly masks and of few.
    base, model = adapted(scale=0.5)
    base, model = base.to(torch.bfloat16), model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 90, (1, 24), generator=g)
    x[0, 4:] = MASK
    wide = torch.cat([x, torch.randint(0, 90, (3, 24), generator=g)])  # 20 masks of 96 positions
    with torch.inference_mode():
        for tokens, dense in ((x, True), (wide, False)):
            got, ref = model(tokens), base(tokens)
            assert model.adapter.dense == dense
            clean = tokens != MASK
            assert torch.equal(got[clean], ref[clean])
            assert not torch.allclose(got[~clean].float(), ref[~clean].float(), atol=1e-2)
    assert all(A.dtype == B.dtype == torch.float32 for A, B in model.adapter.kept.values())


def test_decoding_reads_the_adapters_weights_as_they_are_after_a_change():
    # Decoding keeps each group's stacked weights between forwards; changing a weight in place (an optimiser
    # step, a load) must reach the next forward.
    _, model = adapted(scale=0.5)
    x = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    x[0, 3:] = MASK
    with torch.no_grad():
        before = model(x)
        for p in model.adapter.B.values():
            p.mul_(-1.0)
        after = model(x)
        _, fresh = adapted(scale=0.5)
        for p in fresh.adapter.B.values():
            p.mul_(-1.0)
        assert torch.equal(after, fresh(x)) and not torch.allclose(after, before, atol=1e-3)


def test_decoding_after_a_fused_optimizer_step_or_a_move_reads_the_new_weights():
    # A fused AdamW step (train.py's on CUDA) changes the adapter's weights but not their versions, and .to()
    # replaces their storage: train.update and the adapter's _apply drop the float32 copies decoding keeps,
    # so an eval after a step decodes the weights as they are.
    import train
    from mars.train_settings import Settings

    _, model = adapted(scale=0.5)
    x = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    x[0, 3:] = MASK
    with torch.no_grad():
        before = model(x)  # fills the copies
    params = list(model.adapter.parameters())
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    versions = [p._version for p in params]
    model(x).float().pow(2).mean().backward()
    train.update(model, opt, Settings(), 0.1)
    assert [p._version for p in params] == versions  # the change the versions do not show
    _, fresh = adapted(scale=0.5)
    fresh.adapter.load_state_dict(model.adapter.state_dict())
    with torch.no_grad():
        after, reference = model(x), fresh(x)
    assert torch.equal(after, reference) and not torch.allclose(after, before, atol=1e-3)
    assert model.adapter.kept
    model.adapter.to(torch.float32)
    assert not model.adapter.kept


def test_linears_that_share_an_input_share_its_update_and_give_what_one_update_each_gives(monkeypatch):
    # q, k and v (and gate and up) read one input: one gather and one stacked A matmul serve them all.
    # The same adapter with every linear on its own gives the same logits, up to float32 rounding.
    _, shared = adapted(scale=0.5)
    monkeypatch.setattr(adapter, "SHARED", ())
    _, alone = adapted(scale=0.5)
    assert shared.adapter.group["model.layers.0.self_attn.k_proj"] == [
        f"model.layers.0.self_attn.{m}_proj" for m in "qkv"]
    assert alone.adapter.group["model.layers.0.self_attn.k_proj"] == ["model.layers.0.self_attn.k_proj"]
    x = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(1))
    x[0, 12:], x[1, 5:] = MASK, MASK
    with torch.no_grad():
        got, ref = shared(x), alone(x)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert not shared.adapter.pending  # every update left for a member was taken by it
    batch = make_batch(random_examples(4, seed=3), 4, MASK, PAD)  # and under autograd, the adapter's gradients
    grads = []
    for model in (shared, alone):
        model.adapter.zero_grad()
        adapter_loss(model, batch)[0].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.adapter.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4) and grads[0].abs().sum() > 0


def decode_model():
    # A model whose drafts are right often enough that verify takes several tokens per forward.
    from test_generate import MASK as GEN_MASK

    base, model = tiny_model(2), tiny_model(2)
    ad = adapter.attach(model, GEN_MASK, rank=4, alpha=8.0)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ad.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return base.eval(), model.eval(), GEN_MASK


@pytest.mark.parametrize("cache", ["none", "cursor", "block"])
def test_tau_one_and_verify_give_the_base_greedy_tokens_in_every_cache_mode(cache):
    from test_generate import prompts

    base, model, mask = decode_model()
    ps = prompts()
    greedy, _ = decode(base, ps, mask, set(), Options(tau=1.0, max_new_tokens=24, cache="none"))
    opts = Options(max_new_tokens=24, cache=cache, K=8 if cache == "block" else 0)
    assert decode(model, ps, mask, set(), replace(opts, tau=1.0))[0] == greedy
    if cache != "block":  # verify runs on the none and cursor caches
        for layout in ("tree", "chain"):
            out, forwards = decode(model, ps, mask, set(), replace(opts, verify=True, layout=layout))
            assert out == greedy, layout
    # and the adapter is what drafts: at tau 0 its masks' tokens differ from the base's masks'
    at_zero = Options(tau=0.0, max_new_tokens=24)
    assert decode(model, ps, mask, set(), at_zero)[0] != decode(base, ps, mask, set(), at_zero)[0]


@pytest.mark.parametrize("target", ["data", "self"])
def test_a_zero_adapter_gives_the_base_models_mars_loss(target):
    base, model = adapted()
    batch = make_batch(random_examples(4, seed=1), 4, MASK, PAD)
    reference = mars_loss(base, batch) if target == "data" else distilled_loss(base, batch, mask_target=target)
    _, ref_ar, ref_mask = reference
    loss, loss_ar, loss_mask = adapter_loss(model, batch, mask_target=target)
    assert torch.allclose(loss_mask, ref_mask, atol=1e-5) and torch.allclose(loss_ar, ref_ar, atol=1e-5)
    assert loss is loss_mask
    loss.backward()  # the gradient reaches the adapter alone
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("adapter."))
    assert model.adapter.B["model/layers/0/self_attn/q_proj"].grad.abs().sum() > 0


def test_soft_loss_with_one_hot_targets_is_the_hard_loss():
    torch.manual_seed(0)
    logits, y = torch.randn(7, 11), torch.randint(0, 11, (7,))
    one_hot = torch.full((7, 11), float("-inf")).scatter(1, y[:, None], 0.0)  # softmax: exactly one-hot
    assert torch.allclose(soft_ce(logits, one_hot), F.cross_entropy(logits, y, reduction="none"), atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 3])
def test_no_gradient_reaches_the_targets(chunk):
    model = tiny_model(0, **LOSS_MODEL)
    h, t = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    distill_ce(model, h, t, chunk).sum().backward()
    assert h.grad.abs().sum() > 0 and t.grad is None
    # inside the loss the self targets are the clean stream, detached: only loss_ar's gradient flows there
    batch = make_batch(random_examples(4, seed=2), 4, MASK, PAD)
    clean_only = tiny_model(0, **LOSS_MODEL)
    distilled_loss(clean_only, batch, ar_weight=0.0, mask_target="self")[0].backward()
    embed = clean_only.model.embed_tokens.weight.grad
    assert embed is not None and embed[MASK].abs().sum() > 0  # the noisy stream learns


def run_adapter(tiny, out, *flags):
    from test_train import run

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
    real = keep_base.adapter_loss

    def dying(*a, **k):  # the run dies in its third step, after the step-2 checkpoint
        calls["n"] += 1
        if calls["n"] > 2 * 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(keep_base, "adapter_loss", dying)
    with pytest.raises(KeyboardInterrupt):
        run_adapter(tiny, tmp_path / "b", *flags)
    monkeypatch.setattr(keep_base, "adapter_loss", real)
    resumed = run_adapter(tiny, tmp_path / "b", *flags, "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in unbroken], abs=1e-6)


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


def test_adapter_flags_that_cannot_work_are_refused(tiny, tmp_path):
    for flags in (["--mode", "ar"], ["--lora-rank", "0"]):
        with pytest.raises(SystemExit):
            run_adapter(tiny, tmp_path / "x", "--max-steps", "1", *flags)


def test_mean_init_starts_the_mask_at_the_mean_embedding():
    _, model = tiny_model(0, **LOSS_MODEL), tiny_model(0, **LOSS_MODEL)
    ad = adapter.attach(model, MASK, rank=4, alpha=8.0, embed_init="mean")
    E = model.model.embed_tokens.weight
    assert ad.embed.shape == (E.shape[1],)  # one vector, whatever the slot
    assert torch.allclose(E[MASK] + ad.embed, E[:MASK].mean(0), atol=1e-6)


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


def test_a_mean_init_adapter_decodes_as_the_uncached_reference_and_verify_keeps_the_base():
    from test_generate import MASK as GEN_MASK
    from test_generate import prompts

    from generate import decode_naive

    base, model = tiny_model(2), tiny_model(2)
    ad = adapter.attach(model, GEN_MASK, rank=4, alpha=8.0, embed_init="mean")
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.eval()
    ps = prompts()
    ref = [decode_naive(model, p, GEN_MASK, set(), Options(tau=0.5, B=4, max_new_tokens=16))[0] for p in ps]
    assert decode(model, ps, GEN_MASK, set(), Options(tau=0.5, B=4, max_new_tokens=16))[0] == ref
    assert ref != [decode_naive(base, p, GEN_MASK, set(), Options(tau=0.5, B=4, max_new_tokens=16))[0] for p in ps]
    greedy, _ = decode(base, ps, GEN_MASK, set(), Options(tau=1.0, max_new_tokens=16, cache="none"))
    for budget in (0, 3):
        opts = Options(verify=True, B=4, max_new_tokens=16, draft_budget=budget)
        assert decode(model, ps, GEN_MASK, set(), opts)[0] == greedy


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
