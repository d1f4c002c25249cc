# mars/quantize.py: weight-only int8 / int4 linears and head for decoding (--quantize). Each kernel computes
# what its own dequantized weights say; --verify stays exact, about the quantized model that runs; a gated
# adapter's hooks still apply; a quantized model is never saved or trained.
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import model as model_py
import train
from conftest import tiny_checkpoint, tiny_model
from generate import Options, decode, decode_naive, main
from mars import adapter, cli, cpu_kernels, quantize
from mars.checkpoint import load_model
from mars.quantize import KINDS, QuantizedLinear, int4_weights, int8_weights

ROOT = Path(__file__).resolve().parents[2]
MASK = 63  # the tiny models' mask id: their last vocabulary row


def dequantized(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    # -> (the float matrix the quantized weights stand for, each weight's step: the largest rounding is half of it)
    if kind == "int8":
        q, s = int8_weights(w)
        return q.float() * s.float()[:, None], s.float()[:, None].expand_as(w)
    q, sz = int4_weights(w, quantize.GROUP_SIZE, torch.bfloat16 if kind == "int4" else None)  # cpu_kernels.cpp's: bf16
    s, z = (sz[..., i].t().float().repeat_interleave(quantize.GROUP_SIZE, 1) for i in (0, 1))  # (N, K)
    return (q.float() - 8) * s + z, s


@pytest.fixture(params=[n for n, (_, needs, _) in cpu_kernels.BUILDS.items() if needs <= cpu_kernels.cpu_flags()]
                or ["none"])
def build(request, monkeypatch):
    # Each build of mars/cpu_kernels.cpp this CPU runs: an AVX-512 BF16 CPU runs the AVX2 one too.
    if request.param != "none":
        monkeypatch.setenv("MARS_CPU_KERNELS", request.param)
    cpu_kernels.kernels.cache_clear()
    yield request.param
    cpu_kernels.kernels.cache_clear()


def needs_kernel(kind: str) -> None:
    if kind == "int4" and not cpu_kernels.kernels()[0]:
        pytest.skip(f"mars/cpu_kernels.cpp does not run here: {cpu_kernels.kernels()[1]} (int4 runs int4-torch)")


@pytest.mark.parametrize("kind", KINDS)
def test_each_kernel_computes_its_dequantized_weights_within_the_rounding_bound(kind, build):
    needs_kernel(kind)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(100, 64, generator=g), torch.randn(100, generator=g)  # 100 rows: int4 pads them to 112 or 128
    x = torch.randn(3, 5, 64, generator=g)
    deq, step = dequantized(w, kind)
    assert (w - deq).abs().max() <= 0.5 * step.max() + 1e-6 and (w - deq).abs().max() > 0  # lossy, by its bound
    xk = x.bfloat16().float() if kind == "int4" and build == "avx512bf16" else x  # that build rounds x to bf16
    with torch.no_grad():
        y = QuantizedLinear(w, nn.Parameter(b), kind)(x)
        assert y.shape == (3, 5, 100) and y.dtype == torch.float32
        assert (y - (xk @ deq.t() + b)).abs().max() < 1e-4  # the kernel: its own weights, to float rounding
        # |x W^T - xk deq^T| <= |x| |W - deq|^T + |x - xk| |deq|^T, per output
        bound = x.abs() @ (0.5 * step).t() + (x - xk).abs() @ deq.abs().t()
        err = (y - (x @ w.t() + b)).abs()
        assert (err <= bound + 1e-4).all() and err.max() > 1e-3
        # bfloat16 activations (the kernels' fast dtype on a CPU), scales in bfloat16: its own weights again,
        # to bfloat16 rounding
        wb, bb, xb = w.bfloat16(), b.bfloat16(), x.bfloat16()
        yb = QuantizedLinear(wb, nn.Parameter(bb), kind)(xb)
        ref = xb.float() @ dequantized(wb, kind)[0].t() + bb.float()
        assert yb.dtype == torch.bfloat16 and ((yb.float() - ref).abs() <= 2**-7 * ref.abs() + 0.05).all()


@pytest.mark.parametrize("tied", [True, False])
def test_quantize_swaps_every_linear_and_the_head_and_keeps_no_float_matrix_but_the_embedding(tied):
    m = tiny_model(1, tie_word_embeddings=tied)
    E = m.model.embed_tokens.weight
    fired = []
    m.model.layers[0].mlp.up_proj.register_forward_hook(lambda mod, args, out: fired.append(type(mod)))
    ids = torch.randint(MASK, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(ids)
        assert quantize.quantize(m, "int8") is m
        after = m(ids)
    assert not any(isinstance(mod, nn.Linear) for mod in m.modules())
    assert isinstance(m.lm_head, QuantizedLinear) and m.lm_head.out_features == m.config.vocab_size
    assert m.model.embed_tokens.weight is E  # the lookup stays float
    assert [n for n, p in m.named_parameters() if p.dim() == 2] == ["model.embed_tokens.weight"]
    assert fired == [model_py.Linear, QuantizedLinear]  # the hook moved with the layer
    assert 0 < (after - before).abs().max() < 0.05 * before.abs().max()


def test_int4_needs_whole_groups_and_the_cpu():
    with pytest.raises(ValueError, match="down_proj has 48 inputs, not a multiple of the group size 32"):
        quantize.quantize(tiny_model(1, intermediate_size=48), "int4")
    with pytest.raises(ValueError, match="--quantize int5: choose int8, int4 or int4-torch"):
        quantize.quantize(tiny_model(1), "int5")
    with pytest.raises(ValueError, match="the int4 kernels are CPU ones; use --device cpu, or --quantize int8"):
        quantize.check("int4", "meta", torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_emits_exactly_the_quantized_models_greedy_tokens(kind, build):
    # The spec of docs/method.md §9 about the model that runs: the quantized one, in float32 activations,
    # batch 4 of ragged prompts on the cursor cache; its oracle is decode_naive on the same quantized model.
    needs_kernel(kind)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, MASK - 1, (n,), generator=g).tolist() for n in (3, 17, 40, 1)]
    float_model = tiny_model(1)
    with torch.no_grad():
        m = quantize.quantize(tiny_model(1), kind)
    greedy = Options(tau=1.0, B=4, max_new_tokens=16)
    ref = [decode_naive(m, p, MASK, {13}, greedy)[0] for p in ps]
    assert decode(m, ps, MASK, {13}, greedy)[0] == ref
    for layout in ("tree", "chain"):
        assert decode(m, ps, MASK, {13}, Options(B=4, max_new_tokens=16, verify=True, layout=layout))[0] == ref
    if kind != "int8":  # the oracle is the quantized model's: the float model's greedy tokens differ
        assert ref != [decode_naive(float_model, p, MASK, {13}, greedy)[0] for p in ps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(kind, dtype, build):
    # What exact verify needs from a linear: a forward of n positions gives each what a forward of it alone
    # gives. mars/cpu_kernels.cpp takes rows 4 (AVX2: 2) at a time (1 to 9 rows: every tail), torch's int4
    # kernel 4.
    needs_kernel(kind)
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(200, 96, generator=g, dtype=dtype), torch.randn(200, generator=g, dtype=dtype)
    lin = QuantizedLinear(w, nn.Parameter(b), kind)
    with torch.no_grad():
        for n in range(1, 10):
            x = torch.randn(n, 96, generator=g, dtype=dtype)
            y = lin(x)
            assert y.dtype == dtype and all(torch.equal(lin(x[i:i + 1])[0], y[i]) for i in range(n))


def test_pack_int4_lays_out_the_codes_scales_and_zeros_as_the_kernel_reads_them():
    # The layout of mars/cpu_kernels.cpp's header, read back by index arithmetic (runs on any CPU): for each
    # block of 32 channels and group of 32 inputs, s[32] | z[32] bf16 | 16 input pairs x 32 bytes, byte j
    # of pair p holding channel j // 2's code for input 2p + j % 2 (low nibble) and channel 16 + j // 2's.
    g = torch.Generator().manual_seed(3)
    N, K = 64, 96
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sz = torch.randn(K // 32, N, 2, generator=g).bfloat16()
    packed = cpu_kernels.pack_int4(q, sz)
    assert packed.shape == (N // 32, K // 32, 640) and packed.dtype == torch.uint8
    for b in range(N // 32):
        for grp in range(K // 32):
            tile = packed[b, grp]
            assert torch.equal(tile[:64].view(torch.bfloat16), sz[grp, 32 * b:32 * b + 32, 0])
            assert torch.equal(tile[64:128].view(torch.bfloat16), sz[grp, 32 * b:32 * b + 32, 1])
            for p in range(16):
                for j in range(32):
                    byte = int(tile[128 + 32 * p + j])
                    k = 32 * grp + 2 * p + j % 2
                    assert byte & 15 == q[32 * b + j // 2, k] and byte >> 4 == q[32 * b + 16 + j // 2, k]


def test_the_kernels_check_what_they_are_given():
    # ctypes passes raw pointers: a wrong dtype, device or shape is a clear error before the kernel runs (the
    # checks run on any CPU: they come before the library is needed)
    packed = torch.zeros(2, 2, 640, dtype=torch.uint8)  # pack_int4's bytes for 64 x 64
    with pytest.raises(TypeError, match="takes float32 or bfloat16 activations on the CPU, not torch.float16"):
        cpu_kernels.int4_mm(torch.randn(2, 64).half(), packed, None, 40)
    with pytest.raises(ValueError, match="is not pack_int4's bytes for 40 x 64"):
        cpu_kernels.int4_mm(torch.randn(2, 64), packed[:1], None, 40)
    with pytest.raises(ValueError, match="or the bias is not"):
        cpu_kernels.int4_mm(torch.randn(2, 64), packed, torch.zeros(39), 40)
    x, A, Bt = torch.zeros(3, 64).bfloat16(), torch.zeros(4, 64).bfloat16(), torch.zeros(4, 40).bfloat16()
    with pytest.raises(ValueError, match="lowrank_add: x"):
        cpu_kernels.lowrank_add(x, A, Bt, torch.zeros(3), torch.zeros(3, 40))  # y float32
    with pytest.raises(ValueError, match="lowrank_add: x"):
        cpu_kernels.lowrank_add(x[:, :48], A[:, :48], Bt, torch.zeros(3), torch.zeros(3, 40).bfloat16())  # K 48
    if not cpu_kernels.kernels()[0]:
        return
    lin = QuantizedLinear(torch.randn(40, 64), nn.Parameter(torch.randn(40)), "int4")
    x = torch.randn(3, 64)
    before = lin(x)
    lin.to(torch.bfloat16)  # a model cast after quantizing: its bias buffer becomes bf16, read as float32 still
    assert lin.float_bias.dtype == torch.bfloat16 and (lin(x) - before).abs().max() < 0.05


def test_the_lowrank_kernel_adds_at_the_gated_rows_alone():
    # y[m] += (A x[m]) B^T gate[m]: the gated rows as the float32 matmuls give them, to bf16 rounding; every
    # other row keeps its bits. N = 40: a tail of 8 channels after two blocks of 16.
    if not cpu_kernels.has_lowrank(cpu_kernels.kernels()[0]):
        pytest.skip(f"mars/cpu_kernels.cpp has no lowrank_add here: {cpu_kernels.kernels()[1] or 'no AVX-512 BF16'}")
    g = torch.Generator().manual_seed(4)
    M, K, N, r = 6, 96, 40, 8
    x, A, B = (torch.randn(*shape, generator=g).bfloat16() for shape in ((M, K), (r, K), (N, r)))
    y = torch.randn(M, N, generator=g).bfloat16()
    gate = torch.tensor([0.0, 2.0, 0.0, 2.0, 2.0, 0.0])
    out = y.clone()
    cpu_kernels.lowrank_add(x, A, B.t().contiguous(), gate, out)
    on = gate != 0
    assert torch.equal(out[~on], y[~on])
    ref = y.float() + (x.float() @ A.float().t() * gate[:, None]) @ B.float().t()
    assert ((out[on].float() - ref[on]).abs() <= 2**-7 * ref[on].abs() + 1e-2).all()
    assert (out[on].float() - y[on].float()).abs().max() > 1  # it added something


def test_int4_runs_torchs_kernel_where_its_own_cannot_run(monkeypatch, capsys, tmp_path):
    # A CPU without AVX-512 BF16, or no compiler: --quantize int4 still decodes, by torch's kernel, with a note
    build = cpu_kernels.kernels.__wrapped__  # the uncached builder
    monkeypatch.setattr(quantize, "kernels", lambda: (None, "this CPU has no AVX-512 BF16"))
    m = quantize.quantize(tiny_model(1), "int4")
    assert {mod.kind for mod in m.modules() if isinstance(mod, QuantizedLinear)} == {"int4-torch"}
    assert capsys.readouterr().err == "note: --quantize int4 runs torch's int4 kernel: this CPU has no AVX-512 BF16\n"
    with pytest.raises(ValueError, match="mars/cpu_kernels.cpp cannot run here: this CPU has no AVX-512 BF16"):
        QuantizedLinear(torch.zeros(32, 32), None, "int4")
    monkeypatch.delenv("MARS_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"sse4_2", "avx"})
    assert build() == (None, "this CPU has no AVX-512 BF16, nor AVX2 with FMA")
    monkeypatch.setenv("MARS_CPU_KERNELS", "avx512bf16")
    assert build() == (None, "this CPU has no AVX-512 BF16")
    monkeypatch.setenv("MARS_CPU_KERNELS", "neon")
    assert build() == (None, "MARS_CPU_KERNELS=neon: choose one of avx512bf16, avx2")
    monkeypatch.setenv("MARS_CPU_KERNELS", "")  # empty: as unset
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512bw", "avx512vl", "avx512_bf16"})
    assert cpu_kernels.builds_for_this_cpu() == (["avx512bf16", "avx2"], "")  # fastest first
    monkeypatch.setenv("MARS_CPU_KERNELS", "avx2")
    assert cpu_kernels.builds_for_this_cpu() == (["avx2"], "")  # or the one asked for
    monkeypatch.delenv("MARS_CPU_KERNELS")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx512bw", "avx512vl", "avx512_bf16"})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert build() == (None, "no C++ compiler (/nonexistent/c++) to build mars/cpu_kernels.cpp; install g++ or set CXX")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no library built there yet
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    capsys.readouterr()
    assert build() == (None, "false could not build mars/cpu_kernels.cpp (AVX-512 BF16): ?")
    cache = tmp_path / "cache" / "mars"
    note = f"note: building mars/cpu_kernels.cpp (AVX-512 BF16) into {cache} (once per version)\n"
    assert capsys.readouterr().err == note
    assert not list((tmp_path / "cache" / "mars").iterdir())  # no half-written library left
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a cache that cannot be made
    library, why = build()
    assert library is None and why.startswith("mars/cpu_kernels.cpp: [Errno 20] Not a directory")


def test_a_compiler_without_avx512_bf16_still_builds_the_avx2_kernel(monkeypatch, capsys, tmp_path):
    # An AVX-512 BF16 CPU with a compiler that does not know -mavx512bf16 (GCC before 10): the AVX2 build runs.
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here")
    old = tmp_path / "old-c++"
    old.write_text('#!/bin/sh\ncase "$*" in *avx512bf16*) echo "error: unrecognized -mavx512bf16" >&2; exit 1;; '
                   'esac\nexec c++ "$@"\n')
    old.chmod(0o755)
    monkeypatch.setenv("CXX", str(old))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MARS_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512bw", "avx512vl", "avx512_bf16"})
    library, why = cpu_kernels.kernels.__wrapped__()
    assert why == "" and library.build == "avx2" and not cpu_kernels.has_lowrank(library)
    err = capsys.readouterr().err
    assert "(AVX-512 BF16)" in err and "(AVX2 with FMA)" in err  # tried in that order


@pytest.mark.parametrize("K", [7, 24, 40])  # widths torch's bf16 int8 kernel would read past (or crash on)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_computes_its_dequantized_weights_at_any_width(K, dtype):
    g = torch.Generator().manual_seed(K)
    w, x = torch.randn(48, K, generator=g).to(dtype), torch.randn(3, K, generator=g).to(dtype)
    deq, _ = dequantized(w, "int8")
    with torch.no_grad():
        y = QuantizedLinear(w, None, "int8")(x).float()
    ref = x.float() @ deq.t()
    assert ((y - ref).abs() <= 2e-2 * ref.abs() + 2e-2).all()


def test_a_failed_link_falls_back_to_the_next_build_and_says_why(monkeypatch, capsys, tmp_path):
    # The AVX-512 BF16 build fails to link (a missing library: the linker removes its own output): the AVX2
    # build runs, a note names the linker's reason, and the library is readable by every user of the cache.
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here")
    cxx = tmp_path / "c++"
    cxx.write_text('#!/bin/sh\ncase "$*" in *avx512bf16*) exec c++ "$@" -lmars_missing;; esac\nexec c++ "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", f"env {cxx}")  # a command with its arguments, as "ccache g++"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MARS_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512bw", "avx512vl", "avx512_bf16"})
    library, why = cpu_kernels.kernels.__wrapped__()
    assert why == "" and library.build == "avx2"
    assert "could not build mars/cpu_kernels.cpp (AVX-512 BF16): " in capsys.readouterr().err
    assert "mars_missing" in cpu_kernels.load("avx512bf16")[1]  # the linker's line, not collect2's
    [lib] = (tmp_path / "cache" / "mars").iterdir()
    assert lib.stat().st_mode & 0o005 == 0o005  # read and run by others


def test_a_damaged_cached_library_is_built_again(monkeypatch, capsys, tmp_path):
    if shutil.which("c++") is None or not cpu_kernels.builds_for_this_cpu()[0]:
        pytest.skip("no C++ compiler or no kernel build for this CPU here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name = cpu_kernels.builds_for_this_cpu()[0][-1]
    # built by another process: this one never maps the file it damages
    subprocess.run([sys.executable, "-c", f"from mars import cpu_kernels; assert cpu_kernels.load({name!r})[0]"],
                   cwd=ROOT, check=True, capture_output=True)
    [lib] = (tmp_path / "cache" / "mars").iterdir()
    lib.write_bytes(b"")  # a disk that filled up, an interrupted copy of the cache
    capsys.readouterr()
    library, why = cpu_kernels.load(name)
    assert library is not None and why == "" and lib.stat().st_size > 0
    assert "does not load" in capsys.readouterr().err


@pytest.mark.parametrize("ids", [[[3, 9, 5, 5]], [[3, 9, 7, 5]]])  # mostly masks (dense updates) and one
def test_a_gated_adapter_on_a_quantized_base_changes_the_mask_positions_only(ids):
    ids = torch.tensor(ids)
    base = quantize.quantize(tiny_model(1), "int8")
    m = tiny_model(1)
    a = adapter.attach(m, mask_id=5)
    with torch.no_grad():
        for p in a.B.values():
            p.normal_(0, 0.5)  # a trained-looking adapter: its hooks change the logits at the masks
        quantize.quantize(m, "int8")
        plain, gated = base(ids), m(ids)
    masks = ids[0] == 5
    assert torch.equal(gated[:, ~masks], plain[:, ~masks])  # clean positions: the quantized base's, bit for bit
    assert (gated[:, masks] - plain[:, masks]).abs().max() > 1e-2  # the hooks fired on the quantized layers


def test_a_quantized_model_is_not_saved_or_trained(tmp_path, capsys):
    m = quantize.quantize(tiny_model(1), "int4")
    with pytest.raises(RuntimeError, match="holds no float weights to save or train"):
        m.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(SystemExit) as e:
        train.main(["--quantize", "int8", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert err == ("train.py: error: --quantize: quantization is for decoding (generate.py, serve.py, eval.py); "
                   "training needs float weights: drop the flag")
    assert not (tmp_path / "run").exists()


def test_load_model_quantizes_instead_of_the_few_rows_order(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "m")
    m = load_model(tmp_path / "m", "cpu", torch.float32, quantize="int4")
    # the float32 note is torch's kernels': the project's int4 one takes float32 activations as they come
    assert ("torch's CPU kernels are fast in bfloat16" in capsys.readouterr().err) == (not cpu_kernels.kernels()[0])
    kind = "int4" if cpu_kernels.kernels()[0] else "int4-torch"  # the project's kernel where it runs
    assert type(m.model.layers[0].mlp.up_proj) is QuantizedLinear and m.lm_head.kind == kind and not m.training
    assert m.head_linear.func is quantize.quantized_head


def test_generate_cli_decodes_the_quantized_model(tmp_path, capsys, monkeypatch):
    path = tmp_path / "ckpt"
    _, tok = tiny_checkpoint(path, spread=0, sharpen=40, max_position_embeddings=128)
    main(["--ckpt", str(path), "--prompt", "hi", "--prompt", "add 3 4", "--max-new-tokens", "8", "--json",
          "--verify", "--draft-budget", "0", "--quantize", "int8", "--dtype", "float32", "--verbose"])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()[:-1]]
    m = load_model(path, "cpu", torch.float32, quantize="int8")
    greedy = Options(tau=1.0, B=4, max_new_tokens=8)
    assert [r["output_ids"] for r in rows] == [decode_naive(m, r["prompt_ids"], tok.mask_id, tok.stop_ids, greedy)[0]
                                               for r in rows]
    assert "'quantize': 'int8'" in err  # the resolved settings say so
    assert "--quantize int8 with float32 activations: torch's CPU kernels are fast in bfloat16" in err
    # --dtype auto decodes a quantized model in bfloat16 on the CPU (but int4 on the AVX2 build: below); float32
    # when asked
    assert cli.device_and_dtype("cpu", "auto", "int8") == ("cpu", torch.bfloat16)
    assert cli.device_and_dtype("cpu", "auto", "none") == ("cpu", torch.float32)
    assert cli.device_and_dtype("cpu", "float32", "int4") == ("cpu", torch.float32)
    # int4 on the AVX2 build: float32, where bf16 arithmetic is slow; on the AVX-512 BF16 build: bf16
    for build, dtype in (("avx2", torch.float32), ("avx512bf16", torch.bfloat16), (None, torch.bfloat16)):
        monkeypatch.setattr(cpu_kernels, "loaded_build", lambda build=build: build)
        assert cli.device_and_dtype("cpu", "auto", "int4") == ("cpu", dtype), build
        assert cli.device_and_dtype("cpu", "auto", "int8") == ("cpu", torch.bfloat16)
    from mars import eval as ev
    from mars import serve
    for settings in (serve.Settings, ev.Settings):  # serve.py and eval.py take the flag too
        assert cli.parse(settings, ["--quantize", "int4"], "").quantize == "int4"
