# CPU decoding speed, opt-in (style principle 14: the eager model.py stays the reference). A decode step
# feeds a few positions per row, and the BLAS torch ships (MKL) gives F.linear's (n, in) x (in, out) product
# 2 to 3x the time of one row for n from 2 to 8, where the same product in the order (W x^T)^T stays near
# it; past 8 rows the two orders trade places from one n to the next (tools/forward_cost.py --f-linear-too
# measures both, docs/benchmarks.md). The values are the same up to float rounding.
# mars.checkpoint.load_model turns this on for CPU float32 models that decode (generate, serve, eval).
from __future__ import annotations

from functools import partial

import torch

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
