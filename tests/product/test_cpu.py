# mars/cpu.py: the CPU decoding order of a few rows, (W x^T)^T, opt-in per model (use_few_rows), and the
# loader that turns it on for CPU float32 models that decode; tools/forward_cost.py times it against
# model.py's plain linears and reports what a decode step allocates. And a gated adapter's updates by
# mars/cpu_kernels.cpp on a bf16 model (use_lowrank_kernel).
import json

import pytest
import torch
import torch.nn.functional as F

import model
from conftest import tiny_checkpoint, tiny_model
from mars import adapter, cpu, cpu_kernels, quantize
from mars.checkpoint import load_model
from mars.cpu import FEW_ROWS, FewRowsLinear, few_rows_linear, use_few_rows, use_lowrank_kernel


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_the_few_rows_linear_is_f_linear_up_to_rounding_and_f_linear_under_autograd():
    # A decode step's 2..FEW_ROWS rows run as (W x^T)^T: the same product, summed in another order.
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    for rows in (1, 2, 5, FEW_ROWS, FEW_ROWS + 1):
        x = torch.randn(1, rows, 64, generator=g)
        with torch.no_grad():
            y = few_rows_linear(x, w, b)
            # bit for bit what the CLIs computed before the order moved here: (W x^T)^T + b or F.linear
            assert torch.equal(y, (w @ x[0].t()).t()[None] + b if 2 <= rows <= FEW_ROWS else F.linear(x, w, b))
            assert torch.equal(few_rows_linear(x, w, b, rows=0), F.linear(x, w, b))  # rows=0: F.linear
        assert y.shape == (1, rows, 300) and y.is_contiguous()
        assert max_diff(y, F.linear(x, w, b)) < 1e-4
        assert max_diff(few_rows_linear(x, w), F.linear(x, w)) < 1e-4
    x = torch.randn(3, 4, 64, generator=g, requires_grad=True)
    y = few_rows_linear(x, w, b)  # autograd on: F.linear itself, bit for bit, and its gradient
    assert torch.equal(y, F.linear(x, w, b))
    y.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(3, 4, 64), atol=1e-4)  # a sum of 300 in another order
    with torch.no_grad():  # bfloat16 keeps F.linear
        xb, wb = x.detach()[:1, :3].bfloat16(), w.bfloat16()
        assert torch.equal(few_rows_linear(xb, wb), F.linear(xb, wb))


def test_use_few_rows_swaps_the_linears_and_the_head_and_keeps_parameters_keys_and_hooks():
    m = tiny_model(tie_word_embeddings=False, num_key_value_heads=4)
    params, keys = dict(m.named_parameters()), list(m.state_dict())
    plain_modules = [n for n, mod in m.named_modules() if isinstance(mod, model.Linear)]
    assert len(plain_modules) == 7 * m.config.num_hidden_layers + 1  # the projections and the untied lm_head
    fired = []
    m.model.layers[0].self_attn.q_proj.register_forward_hook(lambda mod, args, out: fired.append(type(mod)))
    ids = torch.randint(m.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # 6 rows: every linear and the head take the few-rows order once swapped
        plain = m(ids)
        assert use_few_rows(m) is m
        fast = m(ids)
    assert all(isinstance(mod, FewRowsLinear) for n, mod in m.named_modules() if n in plain_modules)
    assert m.head_linear.func is few_rows_linear and m.head_linear.keywords == {"rows": FEW_ROWS}
    assert all(p is params[n] for n, p in m.named_parameters()) and list(m.state_dict()) == keys  # the same objects
    assert 0 < max_diff(fast, plain) < 1e-4  # another order of the same sums
    with torch.no_grad():
        use_few_rows(m, 0)  # model.py's linears back: F.linear, bit for bit as before the swap
        assert torch.equal(m(ids), plain)
    assert all(type(mod) is model.Linear for n, mod in m.named_modules() if n in plain_modules)
    assert m.head_linear is model.linear and fired == [model.Linear, FewRowsLinear, model.Linear]


def test_a_gated_adapter_keeps_its_hooks_through_the_swap():
    # mars/adapter.py adds its update in forward hooks on the linears: they move to the swapped modules.
    m = tiny_model(1)
    a = adapter.attach(m, mask_id=5)
    ids = torch.tensor([[3, 9, 5, 5]])
    with torch.no_grad():
        for p in a.B.values():
            p.normal_(0, 0.5)  # a trained-looking adapter: it changes the logits at the masks
        before = m(ids)
        use_few_rows(m)
        after = m(ids)
        for name in a.names:  # the comparison can fail: without the linears' hooks the logits differ
            m.get_submodule(name)._forward_hooks.clear()
        unhooked = m(ids)
    assert max_diff(after, before) < 1e-5 and max_diff(unhooked, before) > 1e-2


def test_load_model_turns_it_on_for_cpu_float32_decoding_only(tmp_path):
    tiny_checkpoint(tmp_path / "m")
    assert isinstance(load_model(tmp_path / "m", "cpu", torch.float32).model.layers[0].mlp.up_proj, FewRowsLinear)
    for loaded in (load_model(tmp_path / "m", "cpu", torch.bfloat16),
                   load_model(tmp_path / "m", "cpu", torch.float32, decoding=False)):  # training's resume
        assert type(loaded.model.layers[0].mlp.up_proj) is model.Linear and loaded.head_linear is model.linear


def test_forward_cost_times_both_orders_and_reports_bytes_per_step(tmp_path, monkeypatch):
    from tools import forward_cost

    tiny_checkpoint(tmp_path / "ckpt")
    orders = []
    measure = forward_cost.budget.measure

    def recorded(m, *args):
        orders.append((type(m.model.layers[0].self_attn.o_proj).__name__, getattr(m.head_linear, "func", None)))
        return measure(m, *args)

    def head_seconds(m, rows, reps):
        orders.append(type(m.model.layers[0].mlp.down_proj).__name__)
        return [1.0] * len(rows)

    monkeypatch.setattr(forward_cost.budget, "measure", recorded)
    monkeypatch.setattr(forward_cost, "head_seconds", head_seconds)
    out = tmp_path / "cost.json"
    forward_cost.main(["--ckpt", str(tmp_path / "ckpt"), "--dtypes", "float32", "--rows", "1", "--widths", "1", "4",
                       "--reps", "1", "--f-linear-too", "--head-rows", "4", "--out", str(out)])
    curve = json.loads(out.read_text())["models"]["ckpt"]["float32"]["1"]
    assert curve["n"] == [1, 4] and len(curve["seconds"]) == len(curve["seconds_f_linear"]) == 2
    assert orders == [("FewRowsLinear", few_rows_linear), ("Linear", None), "FewRowsLinear"]  # the head as loaded
    assert len(curve["bytes"]) == 2 and 0 < curve["bytes"][0] < curve["bytes"][1]
    # what a step allocates does not follow the cache's length
    m = load_model(tmp_path / "ckpt", "cpu", torch.float32)
    near, far = (forward_cost.step_bytes(m, 2, 4, context).bytes for context in (16, 200))
    c = m.config
    assert far - near < 2 * c.num_attention_heads * (200 - 16) * c.head_dim * 4, (near, far)


def test_forward_cost_drift_is_how_far_one_positions_logits_move_with_the_width(tmp_path, monkeypatch):
    # A head that adds 0.01 per position fed makes the width's effect known: n positions move the first one's
    # logits by (n - 1) * 0.01, and by the float rounding the width brings, far smaller. Its largest logit and
    # top-two gap are the uncached forward's at that position.
    # --drift-only keeps the curves already in --out.
    from tools import forward_cost

    tiny_checkpoint(tmp_path / "ckpt")
    m = load_model(tmp_path / "ckpt", "cpu", torch.float32)
    m.head_linear = lambda h, w: model.linear(h, w) + 0.01 * h.shape[-2]
    drift = forward_cost.logit_drift(m, [1, 2, 5], context=7)
    assert drift["max_abs_difference"] == pytest.approx([0.0, 0.01, 0.04], abs=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(m.config.vocab_size, (1, 7 + 5), generator=g)
    with torch.no_grad():
        reference = m(ids[:, :8])[0, 7] - 0.08 + 0.01  # its own width's offset, for width 1's
    top = reference.topk(2).values
    assert drift["largest_logit"] == pytest.approx(reference.abs().max().item(), abs=1e-5)
    assert drift["top_two_gap"] == pytest.approx((top[0] - top[1]).item(), abs=1e-5)
    out = tmp_path / "cost.json"
    out.write_text(json.dumps({"models": {"ckpt": {"float32": {"1": {"n": [1]}}}}}))
    forward_cost.main(["--ckpt", str(tmp_path / "ckpt"), "--drift-only", "--dtypes", "float32", "--widths", "1", "4",
                       "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["models"] == {"ckpt": {"float32": {"1": {"n": [1]}}}}
    kept = report["logit_drift"]["ckpt"]["float32"]
    assert kept["n"] == [1, 4] and kept["max_abs_difference"][0] == 0.0 and kept["measured_with"]["cpu"]


def test_forward_cost_times_quantized_weights_with_their_own_linears_and_head(tmp_path, monkeypatch):
    from mars.quantize import QuantizedLinear, quantized_head
    from tools import forward_cost

    tiny_checkpoint(tmp_path / "ckpt")
    seen = []
    measure = forward_cost.budget.measure

    def recorded(m, *args):
        seen.append((type(m.model.layers[0].self_attn.o_proj), getattr(m.head_linear, "func", None)))
        return measure(m, *args)

    monkeypatch.setattr(forward_cost.budget, "measure", recorded)
    out = tmp_path / "cost.json"
    forward_cost.main(["--ckpt", str(tmp_path / "ckpt"), "--dtypes", "bfloat16", "--quantize", "none", "int8",
                       "--rows", "1", "--widths", "1", "4", "--reps", "1", "--f-linear-too", "--out", str(out)])
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"ckpt", "ckpt int8"} and len(models["ckpt int8"]["bfloat16"]["1"]["seconds"]) == 2
    assert seen[2:] == [(QuantizedLinear, quantized_head)] * 2  # the few-rows swap leaves a quantized model alone
    with pytest.raises(SystemExit, match="--quantize int5: choose none, int8, int4 or int4-torch"):
        forward_cost.main(["--ckpt", str(tmp_path / "ckpt"), "--quantize", "int5"])


@pytest.mark.parametrize("quantized", [False, True])
def test_the_lowrank_kernel_adds_the_adapters_update_at_the_masks_and_leaves_every_clean_bit(quantized):
    if not cpu_kernels.has_lowrank(cpu_kernels.kernels()[0]):
        pytest.skip(f"mars/cpu_kernels.cpp has no lowrank_add here: {cpu_kernels.kernels()[1] or 'no AVX-512 BF16'}")
    ids = torch.tensor([[3, 9, 7, 5, 5, 5]])  # 5: the mask; a clean position sees no mask (causal)
    base, m = tiny_model(1).bfloat16(), tiny_model(1).bfloat16()
    ad = adapter.attach(m, mask_id=5)
    with torch.no_grad():
        for p in ad.B.values():
            p.normal_(0, 0.5)  # a trained-looking adapter
        ad.to(torch.bfloat16)  # as adapter.load gives it to a bf16 model
        if quantized:
            quantize.quantize(base, "int4")
            quantize.quantize(m, "int4")
        plain, matmuls = base(ids), m(ids)
        assert use_lowrank_kernel(m)
        fused = m(ids)
    masks = ids[0] == 5
    assert torch.equal(fused[:, ~masks], plain[:, ~masks])  # clean positions: the base's, bit for bit
    moved = (matmuls[:, masks] - plain[:, masks]).abs().max()
    assert moved > 0.5  # the adapter changes the masks' logits...
    assert (fused[:, masks] - matmuls[:, masks]).abs().max() < 0.05 * moved  # ...and the kernel as the matmuls do
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:  # what torch.compile traces: the matmuls
        mp.setattr(torch.compiler, "is_compiling", lambda: True)
        assert torch.equal(m(ids), matmuls)
    float_model = tiny_model(1)
    adapter.attach(float_model, mask_id=5)
    assert not use_lowrank_kernel(float_model)  # float32: the matmuls stay


def test_load_model_turns_the_adapters_kernel_on_when_decoding_and_it_steps_aside_where_it_cannot_run(
        tmp_path, monkeypatch):
    tiny_checkpoint(tmp_path / "m")
    calls = []
    monkeypatch.setattr(cpu, "use_lowrank_kernel", lambda m: calls.append(m) or False)
    load_model(tmp_path / "m", "cpu", torch.bfloat16)
    load_model(tmp_path / "m", "cpu", torch.bfloat16, decoding=False)  # training: the matmuls
    assert len(calls) == 1
    monkeypatch.undo()
    m = tiny_model(1).bfloat16()
    adapter.attach(m, mask_id=5)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: (None, "this CPU has no AVX-512 BF16"))
    assert not use_lowrank_kernel(m) and m.adapter.lowrank is None  # no kernel: the matmuls, silently


def test_forward_cost_times_an_adapter_with_its_matmuls_beside_its_kernel(tmp_path, monkeypatch):
    from tools import forward_cost

    tiny_checkpoint(tmp_path / "ckpt")
    m = tiny_model(1).bfloat16()
    ad = adapter.attach(m, mask_id=5)
    kernel_calls, matmul_runs = [], []
    ad.lowrank = lambda name, x, out: kernel_calls.append(name)  # None: the matmuls do the update
    monkeypatch.setattr(forward_cost, "load_model", lambda *a, **k: m)
    measure = forward_cost.budget.measure
    monkeypatch.setattr(forward_cost.budget, "measure",
                        lambda model, *a: matmul_runs.append(ad.lowrank is None) or measure(model, *a))
    out = tmp_path / "cost.json"
    forward_cost.main(["--ckpt", str(tmp_path / "ckpt"), "--dtypes", "bfloat16", "--rows", "1", "--widths", "1",
                       "3", "--reps", "1", "--adapter-matmuls-too", "--out", str(out)])
    curve = json.loads(out.read_text())["models"]["ckpt"]["bfloat16"]["1"]
    assert len(curve["seconds"]) == len(curve["seconds_adapter_matmuls"]) == 2
    assert matmul_runs == [False, True] and kernel_calls and ad.lowrank is not None  # restored after
