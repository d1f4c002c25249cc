# The gated mask adapter (adapter.py) and self-distilled mask targets (docs/method.md §10), in float32
# on tiny random models: clean positions compute the base model bit for bit, decoding keeps the base's
# greedy tokens in every cache mode, and the two-pass adapter loss is the MARS loss.
from dataclasses import replace

import pytest
import torch
from test_train import MASK, PAD

import train
from conftest import LOSS_MODEL, random_examples, tiny_model
from data import make_batch
from generate import Options, decode
from mars import adapter
from train import loss_variant, mars_loss


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
    _, model = adapted(scale=0.5)
    x = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(3))
    x[0, 3:] = MASK
    with torch.no_grad():
        before = model(x)  # fills the copies
    params = list(model.adapter.parameters())
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    versions = [p._version for p in params]
    model(x).float().pow(2).mean().backward()
    train.update(model, opt, train.parse_settings([]), 0.1)  # the default --grad-clip
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
        mars_loss(model, batch, variant=loss_variant("self", "gated-lora"))[0].backward()
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
    _, ref_ar, ref_mask = mars_loss(base, batch, variant=loss_variant(target))  # None for "data": the paper's
    loss, loss_ar, loss_mask = mars_loss(model, batch, variant=loss_variant(target, "gated-lora"))
    assert torch.allclose(loss_mask, ref_mask, atol=1e-5) and torch.allclose(loss_ar, ref_ar, atol=1e-5)
    assert loss is loss_mask
    loss.backward()  # the gradient reaches the adapter alone
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("adapter."))
    assert model.adapter.B["model/layers/0/self_attn/q_proj"].grad.abs().sum() > 0


def test_mean_init_starts_the_mask_at_the_mean_embedding():
    _, model = tiny_model(0, **LOSS_MODEL), tiny_model(0, **LOSS_MODEL)
    ad = adapter.attach(model, MASK, rank=4, alpha=8.0, embed_init="mean")
    E = model.model.embed_tokens.weight
    assert ad.embed.shape == (E.shape[1],)  # one vector, whatever the slot
    assert torch.allclose(E[MASK] + ad.embed, E[:MASK].mean(0), atol=1e-6)


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


