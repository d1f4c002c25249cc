# What must hold on every device the code runs on, in float32 (exact, as the CPU tests) and in
# bfloat16 (close): the training loss with its split attention and chunked cross-entropy, and the
# KV cache. The suite runs them on the CPU; tools/gpu_check.py runs them on CUDA
# (MARS_TEST_DEVICE=cuda), where masked attention takes the expanded-k/v kernel path.
import contextlib
import os
import warnings
from dataclasses import replace

import pytest
import torch
from test_generate import MASK as GEN_MASK
from test_generate import prompts, verify_prompts
from test_train import LOSS_MODEL, MASK, PAD, random_examples

from conftest import tiny_model
from data import make_batch
from generate import Options, decode
from kvcache import KVCache
from mars.adapter import attach
from train import mars_loss

DEVICE = torch.device(os.environ.get("MARS_TEST_DEVICE", "cpu"))
pytestmark = pytest.mark.cuda


def losses_and_grads(model, batch, dtype, **kw):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        losses = mars_loss(model, batch, 0.5, **kw)
    losses[0].backward()
    return torch.stack(losses).detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_loss_split_and_chunks_on_device(dtype):
    # The split attention (causal kernel + masked call) and chunked CE against one masked call and
    # unchunked CE, on the device; float32 also against the CPU.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    model = tiny_model(7, **LOSS_MODEL).to(DEVICE)  # float32 master weights; bf16 = autocast, as train.py
    batch = make_batch(random_examples(4, seed=8, n=6), 4, MASK, PAD, "mars").to(DEVICE)
    ref, g_ref = losses_and_grads(model, batch, dtype, split=False)
    got, g_got = losses_and_grads(model, batch, dtype, chunk=5)
    assert torch.isfinite(got).all() and (got - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())
    for n in g_ref:
        scale = max(1.0, g_ref[n].abs().max().item())
        assert (g_got[n] - g_ref[n]).abs().max() <= (1e-5 if dtype == torch.float32 else 5e-2) * scale, n
    if dtype == torch.float32:
        cpu = tiny_model(7, **LOSS_MODEL)
        cpu_losses, _ = losses_and_grads(cpu, make_batch(random_examples(4, seed=8, n=6), 4, MASK, PAD, "mars"),
                                         dtype)
        assert (cpu_losses - got).abs().max() <= 1e-4


def test_cached_decoding_equals_uncached_on_device_float32():
    # docs/method.md §7: every cache mode gives the uncached reference's tokens (float32).
    model = tiny_model(1).to(DEVICE)
    ps = prompts()
    ref = decode(model, ps, GEN_MASK, set(), Options(tau=0.6, B=4, max_new_tokens=20, cache="none"))
    assert decode(model, ps, GEN_MASK, set(), Options(tau=0.6, B=4, max_new_tokens=20, cache="cursor")) == ref
    ref_block = decode(model, ps, GEN_MASK, set(), Options(tau=0.6, B=4, max_new_tokens=20, cache="none", K=8))
    assert decode(model, ps, GEN_MASK, set(), Options(tau=0.6, B=4, max_new_tokens=20, cache="block", K=8)) == ref_block


def test_cached_forward_close_to_full_forward_on_device_bf16():
    # In bf16 the cached and full forwards reduce in different orders: close logits, not equal tokens.
    model = tiny_model(1).to(DEVICE, torch.bfloat16)
    x = torch.tensor(prompts((24,))[0], device=DEVICE)[None]
    cache = KVCache(model.config, batch_size=1, max_len=32, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        full = model(x).float()
        outs = [model(x[:, :16], cache=cache)]
        cache.commit(16)
        mask = torch.ones(8, 24, dtype=torch.bool, device=DEVICE).tril(diagonal=16)
        outs.append(model(x[:, 16:], pos=torch.arange(16, 24, device=DEVICE)[None], mask=mask, cache=cache))
    got = torch.cat(outs, dim=1).float()
    assert (got - full).abs().max() <= 0.05 * full.abs().max()


@contextlib.contextmanager
def device_waits():
    # Counts what makes the host wait for the device: on CUDA every synchronizing call (a copy to the host, a
    # blocking copy to the device), as torch.cuda.set_sync_debug_mode reports them; on the CPU, where nothing
    # waits, every read of a tensor's values into Python, which would be one there.
    waits = []
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield waits
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits += [w for w in seen if "synchroniz" in str(w.message)]
        return
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "tolist", lambda t: waits.append("tolist") or tolist(t))
        m.setattr(torch.Tensor, "item", lambda t: waits.append("item") or item(t))
        yield waits


@pytest.mark.parametrize("opts", [Options(tau=0.6), Options(verify=True), Options(verify=True, layout="chain"),
                                  Options(verify=True, draft_budget=3), Options(verify=True, temperature=0.8)],
                         ids=["threshold", "verify", "chain", "budget", "sampled"])
@pytest.mark.parametrize("adapter", [False, True], ids=["plain", "adapter"])
def test_a_decode_step_waits_for_the_device_once(opts, adapter):
    # A step's rule reads the device once, after its forward: the tokens, and for verify rows the acceptance and
    # the next drafts, in one copy; what goes to the device travels without a wait. A gated adapter's eager
    # forward waits once more (it counts its masks). The compiled step's waits are the GPU check's to count
    # (its decode stage, host_waits_per_forward): a compile here would outrun the check's time for these tests.
    model = tiny_model(1)
    if adapter:
        attach(model, GEN_MASK)
    model = model.to(DEVICE)
    ps = verify_prompts(8, seed=8)  # with stop id 13 some rows end early, others run to 24 tokens
    g = torch.Generator(DEVICE)
    with device_waits() as waits:
        out, forwards = decode(model, ps, GEN_MASK, {13}, replace(opts, B=4, max_new_tokens=24), g.manual_seed(0))
    counted = adapter and DEVICE.type == "cuda"  # the adapter's count of its masks
    assert len(waits) == max(forwards) * (2 if counted else 1), waits
    assert any(len(o) < 24 for o in out)  # rows that stop leave the batch, with no wait either
