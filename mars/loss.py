# The two pieces every training loss here is made of: the cross-entropy of the LM head at the
# supervised targets, and each sequence's mean over its own targets, per stream. train.mars_loss puts
# them together as docs/method.md §4 does; the losses of keep_base.py reuse them.
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import Transformer


def chunked(fn: Callable[..., torch.Tensor], chunk: int, *xs: torch.Tensor) -> torch.Tensor:
    # fn(*xs) over `chunk` rows of xs at a time, with the values and gradients of one call. Under
    # autograd each piece runs under activation checkpointing, so one piece's (chunk, V) logits exist
    # at a time, in the forward and again in the backward, which recomputes them. chunk <= 0: one
    # call, its logits kept for the backward (the reference).
    if chunk <= 0:
        return fn(*xs)
    pieces = [tuple(x[i : i + chunk] for x in xs) for i in range(0, len(xs[0]), chunk)]
    if not torch.is_grad_enabled():  # evaluation: no backward, nothing to recompute
        return torch.cat([fn(*p) for p in pieces])
    return torch.cat([checkpoint(fn, *p, use_reentrant=False) for p in pieces])


def target_ce(model: Transformer, h: torch.Tensor, y: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    # h (S, C) hidden states at the S supervised targets, y (S,) their tokens -> (S,) float32 cross-entropy.
    def ce(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model.head(h).float(), y, reduction="none")

    return chunked(ce, chunk, h, y)


def per_seq_means(ce: torch.Tensor, supervised: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    # (R, T) losses and targets -> (loss_ar, loss_mask): each sequence's mean over its own targets in the
    # clean columns (< L) and in the noisy ones, then the mean over the R sequences. An AR batch has no
    # noisy columns: its loss_mask is 0.
    per_seq_ar = ce[:, :L].sum(1) / supervised[:, :L].sum(1).clamp(min=1)  # (R,)
    per_seq_mask = ce[:, L:].sum(1) / supervised[:, L:].sum(1).clamp(min=1)  # (R,)
    return per_seq_ar.mean(), per_seq_mask.mean()
