# CPU decoding speed, opt-in (style principle 14: the eager model.py stays the reference). A decode step
# feeds a few positions per row, and the BLAS torch ships (MKL) gives F.linear's (n, in) x (in, out) product
# 2 to 3x the time of one row for n from 2 to 8, where the same product in the order (W x^T)^T stays near
# it; past 8 rows the two orders trade places from one n to the next (tools/forward_cost.py --f-linear-too
# measures both, docs/benchmarks.md). The values are the same up to float rounding.
# mars.checkpoint.load_model turns this on for CPU float32 models that decode (generate, serve, eval).
# A bfloat16 model with a gated adapter gets the adapter's updates from mars/cpu_kernels.cpp instead, where
# it runs (use_lowrank_kernel).
from __future__ import annotations

from functools import partial

import torch

from mars import cpu_kernels
from mars.adapter import MaskAdapter, key
from model import Linear, Transformer, linear

FEW_ROWS = 8  # up to this many rows, a float32 linear on the CPU without autograd runs as (W x^T)^T


def few_rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                    rows: int = FEW_ROWS) -> torch.Tensor:
    # model.linear, except for 2..rows rows of float32 on the CPU without autograd (a decode step).
    n = x.numel() // x.shape[-1]
    if not 2 <= n <= rows or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return linear(x, w, b)
    y = (w @ x.reshape(n, x.shape[-1]).t()).t()  # (n, out)
    return (y if b is None else y + b).reshape(*x.shape[:-1], w.shape[0]).contiguous()


class FewRowsLinear(Linear):
    rows = FEW_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias, self.rows)


def use_few_rows(model: Transformer, rows: int = FEW_ROWS) -> Transformer:
    # Swaps every model.Linear for a FewRowsLinear (rows=0: back to model.Linear) holding the same
    # parameters, so state_dict keys, checkpoints and optimizers see no change, and the forward hooks of a
    # gated adapter (mars/adapter.py) move with them; the head, tied to the embedding, goes through
    # model.head_linear. In place; returns the model.
    cls = FewRowsLinear if rows else Linear
    for parent in list(model.modules()):
        for name, old in list(parent.named_children()):
            if isinstance(old, Linear):
                new = cls(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
                new.weight, new.bias = old.weight, old.bias
                new._forward_pre_hooks, new._forward_hooks = old._forward_pre_hooks, old._forward_hooks
                new.train(old.training)
                if rows:
                    new.rows = rows
                setattr(parent, name, new)
    model.head_linear = partial(few_rows_linear, rows=rows) if rows else linear
    return model


def use_lowrank_kernel(model: Transformer) -> bool:
    # A bfloat16 model with a gated adapter, decoding on a CPU with AVX-512 BF16: each adapted
    # linear's update at the mask rows becomes one call of its lowrank_add, which reads the adapter's A and
    # B^T in bf16 (the weights' own dtype here) once, instead of the float32 matmuls of MaskAdapter.updates
    # (about 200 a forward, each with a fixed cost that dominates at a few rows). The clean rows are not
    # touched, so they stay the base's bits. -> whether it was turned on.
    ad = getattr(model, "adapter", None)
    w = model.model.embed_tokens.weight
    if not isinstance(ad, MaskAdapter) or w.device.type != "cpu" or w.dtype != torch.bfloat16 \
            or any(A.shape[1] % 32 for A in ad.A.values()) or not cpu_kernels.has_lowrank(cpu_kernels.kernels()[0]):
        return False  # the kernel reads inputs 32 at a time; only the AVX-512 BF16 build has it
    ad.lowrank = partial(lowrank_update, ad)
    return True


def lowrank_update(ad: MaskAdapter, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    # MaskAdapter.lowrank for use_lowrank_kernel: out += scale B A x at the masks, in place -> out; None (the
    # matmuls then) for what the kernel does not take: not bf16 on the CPU (a model cast or moved), an output
    # that is not a fresh contiguous tensor, or a forward torch.compile traces (it cannot trace ctypes).
    # The bf16 copies of A and B^T are kept with the adapter's other decoding copies (dropped when a weight
    # changes).
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or not out.is_contiguous() \
            or x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    kept = ad.kept.get(("lowrank", name))
    if kept is None:
        A, B = ad.A[key(name)].detach(), ad.B[key(name)].detach()
        ad.kept["lowrank", name] = kept = (A.bfloat16().contiguous(), B.t().bfloat16().contiguous())
    flat = out.view(-1, out.shape[-1])
    cpu_kernels.lowrank_add(x.reshape(-1, x.shape[-1]).contiguous(), *kept, ad.gated_scale.view(-1), flat)
    return out
