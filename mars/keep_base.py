# Keeping the base model's output (docs/method.md §10, beyond the paper): what each variant changes in
# train.mars_loss, which computes the loss itself; train.loss_variant builds a Variant from the flags.
# - Self-distilled targets (--mask-target self): a noisy column learns the model's own detached
#   clean-stream distribution at its position instead of the data's token.
# - The gated adapter (--adapter gated-lora): the clean stream is the frozen base. It runs once without
#   autograd, the noisy stream reads its keys and values as constants and trains the adapter alone, and
#   loss_ar is reported, never trained.
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from data import Batch
from model import Transformer


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    # (S, V), (S, V) -> (S,) float32: cross-entropy of logits against target_logits' softmax. No gradient
    # reaches the target.
    p = F.softmax(target_logits.detach().float(), -1)
    return -(p * F.log_softmax(logits.float(), -1)).sum(-1)


def distill_ce(model: Transformer, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # h (S, C) hidden states, t (S, C) the model's own hidden states at the same targets, read as constants
    # -> (S,) soft_ce, both through the head. train.mars_loss runs it chunk by chunk, like its hard targets.
    with torch.no_grad():
        target_logits = model.head(t.detach())
    return soft_ce(model.head(h), target_logits)


def at_targets(h_clean: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # The clean stream's hidden states (R, L, C) at positions pos (R, T - L): the noisy column at position
    # p predicts the same x[p+1] as clean column p, so that is where its self-distilled target is read.
    return h_clean.gather(1, pos[..., None].expand(-1, -1, h_clean.shape[-1]))


class CleanKV:
    # The keys and values of a clean-stream forward, read by the noisy stream's forward after it:
    # recording, each layer's update keeps its (R, Hkv, L, D) keys and values and attends over them;
    # afterwards, each layer attends over those (as constants) followed by its own, the column layout
    # [clean | noisy] that data.Batch.noisy_mask() describes.
    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recording = True

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recording:
            self.kv[layer] = (k, v)
            return k, v
        ck, cv = self.kv[layer]
        return torch.cat([ck, k], 2), torch.cat([cv, v], 2)


@dataclass(frozen=True)
class Variant:
    self_targets: bool = False  # --mask-target self: the noisy columns learn the model's own distribution
    frozen_clean: bool = False  # --adapter gated-lora: the clean stream is the frozen base, never trained

    def hidden(self, model: Transformer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # The gated adapter's forward -> (h_clean (R, L, C), h_noisy (R, T - L, C)). The base, which training
        # never changes, runs the clean stream once without autograd, and the noisy stream reads its keys
        # and values as constants: no backward through the clean columns at all.
        L, kv = batch.L, CleanKV()
        with torch.no_grad():
            h_clean = model.hidden(batch.tokens[:, :L], batch.pos[:, :L], None, kv)  # causal
        kv.recording = False
        return h_clean, model.hidden(batch.tokens[:, L:], batch.pos[:, L:], batch.noisy_mask(), kv)

    def noisy_targets(self, model: Transformer, h_clean: torch.Tensor, batch: Batch,
                      ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]:
        # Self-distilled targets -> (ce, t): t (R, T - L, C) the clean stream's detached hidden states at each
        # noisy column's position, and ce(h, t) -> (S,) the cross-entropy against their distributions.
        return partial(distill_ce, model), at_targets(h_clean.detach(), batch.pos[:, batch.L:])
