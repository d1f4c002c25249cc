# Weight-only int8 / int4 quantization for decoding, opt-in (--quantize): without the flag nothing here
# runs and model.py's float linears stay the reference. At batch 1 a decode step reads every weight once,
# so on a CPU its time is mostly the time to stream the weights from memory: int8 reads half of bfloat16's
# bytes, int4 about 0.3 (half a byte a weight, and a bf16 scale and zero per 32 weights). The kernels:
#   int8: symmetric per output channel, W ~ q s, q (N, K) int8 in [-127, 127], s (N,); torch's
#         _weight_int8pack_mm, in the activations' dtype
#   int4: per group of GROUP_SIZE inputs, W ~ (q - 8) s + z, q in [0, 15], a scale s and zero z per group (the
#         layout of gpt-fast's quantize.py). Where the CPU has AVX-512 BF16 or AVX2 with FMA and a C++
#         compiler is installed, mars/cpu_kernels.cpp, built on first use: with AVX-512 BF16 it multiplies
#         the codes in bf16, so each position a forward feeds (a verify step's) costs less than in torch's
#         kernel; with AVX2, in float32; elsewhere, and with int4-torch, torch's
#         _weight_int4pack_mm_for_cpu, which dequantizes to float32 for every 4 rows it is fed.
#         The two round differently: each is exact about itself, not equal to the other.
# Like mars/cpu.py it swaps modules in place: every linear layer becomes a QuantizedLinear with the old
# one's forward hooks, so a gated adapter's low-rank updates (mars/adapter.py, hooks on each output) still
# apply, in their own dtype. The head, tied or not, becomes model.lm_head, a QuantizedLinear of its
# matrix; a tied model keeps its float embedding for the lookup. Biases and norms stay float. The model
# then holds no float weights to save: its state_dict is refused, and so save_pretrained and checkpoints.
from __future__ import annotations

import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars.cpu_kernels import BLOCK, compiled_int4_mm, int4_mm, kernels, pack_int4
from model import Transformer

# int4 groups of 32 inputs: the smallest group torch's CPU kernel takes (32, 64, 128 or 256), so the closest fit,
# for one (scale, zero) pair per 32 weights (0.125 bytes a weight in bfloat16, beside int4's 0.5). 32 divides
# every Qwen2.5 width (hidden 896 = 28 x 32, intermediate 4864 = 152 x 32; the larger sizes too) and the
# tiny test models' 32 and 64.
GROUP_SIZE = 32
N_TILE = 16  # torch's int4 CPU kernel packs output channels 16 at a time: a head of 260 rows gets zero rows
INT8_K = 16  # torch's int8 kernel reads a row's inputs 16 at a time in bfloat16, past the end of a shorter one
KINDS = ("int8", "int4", "int4-torch")


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # w (N, K) -> q (N, K) int8, s (N,) in w's dtype. The scale is rounded to w's dtype (the kernel reads
    # it there) before q is chosen, so W ~ q s holds for the s the kernel sees.
    w32 = w.float()
    s = (w32.abs().amax(1) / 127).clamp(min=1e-12).to(w.dtype)
    return (w32 / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8), s


def int4_weights(w: torch.Tensor, group: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # w (N, K) -> q (N, K) int32 in [0, 15], scales_and_zeros (K / group, N, 2) in `dtype` (w's by default).
    # Each group maps its [min, max] onto 0..15: W ~ (q - 8) s + z, z = min + 8 s (gpt-fast's asymmetric
    # layout); s and z are rounded to their dtype before q is chosen.
    N, K = w.shape
    dtype = dtype or w.dtype
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)  # (N, K / group)
    s = ((hi - lo) / 15).clamp(min=1e-6).to(dtype)
    z = (lo + 8 * s.float()).to(dtype)
    q = ((g - z.float()[..., None]) / s.float()[..., None] + 8).round().clamp(0, 15)
    return q.to(torch.int32).reshape(N, K), torch.stack([s, z], -1).transpose(0, 1).contiguous()


def int4_kernel_for(device: torch.device, dtype: torch.dtype, group_size: int) -> tuple[str, str]:
    # The kind --quantize int4 runs as -> ("int4", "") for mars/cpu_kernels.cpp, or ("int4-torch", why not)
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or group_size != GROUP_SIZE:
        return "int4-torch", f"mars/cpu_kernels.cpp takes float32 or bfloat16 on the CPU, in groups of {GROUP_SIZE}"
    return ("int4", "") if kernels()[0] else ("int4-torch", kernels()[1])


class QuantizedLinear(nn.Module):
    weight = None  # the float matrix is gone: model.head passes this to head_linear, which ignores it

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, kind: str, group_size: int = GROUP_SIZE):
        # kind: "int8", "int4" (mars/cpu_kernels.cpp; int4_kernel_for says whether it runs) or "int4-torch"
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.kind, self.group_size = kind, group_size
        self.bias = bias  # a Parameter, as it was, or None
        with torch.no_grad():
            if kind == "int8":  # inputs zero-padded to a multiple of INT8_K: torch's bf16 kernel reads 16 at a time
                q, scales = int8_weights(w)
                if self.in_features % INT8_K:  # never at Qwen2.5's widths
                    q = F.pad(q, (0, -self.in_features % INT8_K))
            elif kind == "int4":
                if not kernels()[0] or group_size != GROUP_SIZE:
                    why = kernels()[1] or f"it takes groups of {GROUP_SIZE}, not {group_size}"
                    raise ValueError(f"mars/cpu_kernels.cpp cannot run here: {why}; use int4-torch")
                q, scales = int4_weights(F.pad(w, (0, 0, 0, -len(w) % BLOCK)), group_size, torch.bfloat16)
                q, scales = pack_int4(q, scales), None  # the scales and zeros are in the packed bytes
            else:
                q, scales = int4_weights(F.pad(w, (0, 0, 0, -len(w) % N_TILE)), group_size)
                q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("q", q)  # buffers: .to() moves them; never saved (see refuse_state_dict)
        self.register_buffer("scales", scales)  # int8 (N,); int4-torch scales_and_zeros (K / group, N padded, 2)
        float_bias = bias.detach().float() if kind == "int4" and bias is not None else None
        self.register_buffer("float_bias", float_bias)  # int4: mars/cpu_kernels.cpp adds the bias in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (rows, K)
        if self.kind == "int4":
            mm = compiled_int4_mm if torch.compiler.is_compiling() else int4_mm
            return mm(flat, self.q, self.float_bias, self.out_features).view(*x.shape[:-1], self.out_features)
        if self.kind == "int8":
            if self.in_features % INT8_K:
                flat = F.pad(flat, (0, -self.in_features % INT8_K))
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.q, self.group_size, self.scales)
            y = y[:, :self.out_features].contiguous()  # less the padding rows
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind != "int8" else ""
        return f"{self.in_features}, {self.out_features}, {self.kind}{group}, bias={self.bias is not None}"


def check(kind: str, device: str | torch.device, dtype: torch.dtype) -> None:
    # A ValueError of one line where no kernel runs for this device and dtype: both int4 ones are the CPU's;
    # the int8 one, and the int4 one that would run, are tried on a tiny matrix.
    if kind == "none":
        return
    if kind not in KINDS:
        raise ValueError(f"--quantize {kind}: choose none, {', '.join(KINDS[:-1])} or {KINDS[-1]}")
    device = torch.device(device)
    if kind.startswith("int4") and device.type != "cpu":
        raise ValueError(f"--quantize {kind} on {device}: the int4 kernels are CPU ones; "
                         "use --device cpu, or --quantize int8")
    if kind == "int4":
        kind = int4_kernel_for(device, dtype, GROUP_SIZE)[0]
    try:
        QuantizedLinear(torch.zeros(N_TILE, GROUP_SIZE, device=device, dtype=dtype), None, kind)(
            torch.zeros(1, GROUP_SIZE, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(f"--quantize {kind}: torch {torch.__version__} has no such kernel for {dtype} on {device} "
                         f"({str(e).splitlines()[0]}); use --device cpu, another --dtype, or --quantize none") from None


def refuse_state_dict(*args) -> None:
    raise RuntimeError("a quantized model (mars/quantize.py) holds no float weights to save or train: load the "
                       "checkpoint without --quantize")


def quantize(model: Transformer, kind: str, group_size: int = GROUP_SIZE) -> Transformer:
    # Every linear layer and the head to `kind` (one of KINDS), in place; each float matrix is freed as its
    # layer is swapped. -> the model, for decoding only (no gradient flows through the kernels).
    if kind not in KINDS:
        raise ValueError(f"--quantize {kind}: choose {', '.join(KINDS[:-1])} or {KINDS[-1]}")
    E = model.model.embed_tokens.weight
    check(kind, E.device, E.dtype)
    asked = kind
    if kind == "int4" and (why := int4_kernel_for(E.device, E.dtype, group_size)[1]):
        kind = "int4-torch"
        print(f"note: --quantize int4 runs torch's int4 kernel: {why}", file=sys.stderr)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    widths = {n: model.get_submodule(n).in_features for n in names}  # the head's is q_proj's, the hidden size
    if kind.startswith("int4") and (odd := [n for n in names if widths[n] % group_size]):
        raise ValueError(f"--quantize {asked}: {odd[0]} has {widths[odd[0]]} inputs, not a multiple of the group "
                         f"size {group_size}; use --quantize int8")
    if model.lm_head is None:  # tied: the head's matrix is the embedding, which stays for the lookup
        model.lm_head = nn.Linear(E.shape[1], E.shape[0], bias=False, device="meta")
        model.lm_head.weight = E
        names.append("lm_head")
    for name in names:
        old = model.get_submodule(name)
        new = QuantizedLinear(old.weight.detach(), old.bias, kind, group_size)
        new._forward_pre_hooks, new._forward_hooks = old._forward_pre_hooks, old._forward_hooks
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    model.head_linear = partial(quantized_head, model.lm_head)
    model.register_state_dict_pre_hook(refuse_state_dict)
    return model


def quantized_head(head: QuantizedLinear, h: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return head(h)  # w: model.head's lm_head.weight, None once quantized
