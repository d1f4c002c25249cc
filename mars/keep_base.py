# Keeping the base model's output (docs/method.md §10, beyond the paper): the losses that replace
# parts of train.mars_loss, chosen by train.step_loss.
# - Self-distilled targets (--mask-target self): a noisy column learns the model's own detached
#   clean-stream distribution at its position instead of the data's token.
# - The gated adapter's loss (--adapter gated-lora): the frozen clean stream runs once without autograd,
#   and the noisy stream trains the adapter alone.
from __future__ import annotations

import torch
import torch.nn.functional as F

from data import IGNORE, Batch
from mars.loss import chunked, per_seq_means, target_ce
from model import CausalPrefix, Transformer


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    # (S, V), (S, V) -> (S,) float32: cross-entropy of logits against target_logits' softmax. No gradient
    # reaches the target.
    p = F.softmax(target_logits.detach().float(), -1)
    return -(p * F.log_softmax(logits.float(), -1)).sum(-1)


def distill_ce(model: Transformer, h: torch.Tensor, t: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    # h (S, C) hidden states, t (S, C) the model's own hidden states at the same targets, read as constants
    # -> (S,) soft_ce, both through the head, chunked like loss.target_ce.
    def ce(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target_logits = model.head(t.detach())
        return soft_ce(model.head(h), target_logits)

    return chunked(ce, chunk, h, t)


def at_targets(h_clean: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # The clean stream's hidden states (R, L, C) at positions pos (R, M): the noisy column at position
    # p predicts the same x[p+1] as clean column p, so that is where its self-distilled target is read.
    return h_clean.gather(1, pos[..., None].expand(-1, -1, h_clean.shape[-1]))


def mask_ce(model: Transformer, h_noisy: torch.Tensor, h_clean: torch.Tensor, batch: Batch,
            supervised: torch.Tensor, chunk: int, mask_target: str) -> torch.Tensor:
    # h_noisy (R, M, C), h_clean (R, L, C), supervised (R, M) -> the (S,) cross-entropies of the noisy
    # stream at its targets: against the data's tokens, or (mask_target "self") against the model's own
    # detached clean-stream distribution at the same position.
    if mask_target == "self":
        t = at_targets(h_clean.detach(), batch.pos[:, batch.L:])
        return distill_ce(model, h_noisy[supervised], t[supervised], chunk)
    return target_ce(model, h_noisy[supervised], batch.labels[:, batch.L:][supervised], chunk)


def distilled_loss(model: Transformer, batch: Batch, ar_weight: float = 1.0, chunk: int = 0,
                   mask_target: str = "data") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # train.mars_loss with other targets -> (loss, loss_ar, loss_mask): the noisy columns learn
    # mask_target (mask_ce), the clean ones the data's tokens. mask_target "data" is mars_loss itself.
    L = batch.L
    mask = None if batch.noisy is None else CausalPrefix(L, batch.noisy_mask())
    h = model.hidden(batch.tokens, batch.pos, mask)  # (R, T, C)
    supervised = batch.labels != IGNORE  # (R, T)
    ce = torch.zeros(supervised.shape, dtype=torch.float32, device=h.device)
    clean = supervised.clone()
    clean[:, L:] = False
    ce[clean] = target_ce(model, h[clean], batch.labels[clean], chunk)
    if L < h.shape[1]:
        noisy = supervised[:, L:]
        ce[:, L:][noisy] = mask_ce(model, h[:, L:], h[:, :L], batch, noisy, chunk, mask_target)
    loss_ar, loss_mask = per_seq_means(ce, supervised, L)
    if batch.tokens.shape[1] == L:
        return loss_ar, loss_ar, loss_mask
    return loss_mask + ar_weight * loss_ar, loss_ar, loss_mask


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


def adapter_loss(model: Transformer, batch: Batch, chunk: int = 0, mask_target: str = "self",
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The MARS loss of a gated mask adapter (adapter.py) on a frozen model -> (loss, loss_ar, loss_mask),
    # loss = loss_mask. The clean stream is the base model, which training never changes, so it runs
    # once without autograd and the noisy stream reads its keys and values as constants: no backward
    # through the clean columns at all. loss_ar is reported, never trained.
    L = batch.L
    kv = CleanKV()
    with torch.no_grad():
        h_clean = model.hidden(batch.tokens[:, :L], batch.pos[:, :L], None, kv)  # (R, L, C), causal
    kv.recording = False
    h_noisy = model.hidden(batch.tokens[:, L:], batch.pos[:, L:], batch.noisy_mask(), kv)  # (R, M, C)
    supervised = batch.labels != IGNORE  # (R, T)
    ce = torch.zeros(supervised.shape, dtype=torch.float32, device=h_noisy.device)
    clean, noisy = supervised[:, :L], supervised[:, L:]
    with torch.no_grad():
        ce[:, :L][clean] = target_ce(model, h_clean[clean], batch.labels[:, :L][clean], chunk)
    ce[:, L:][noisy] = mask_ce(model, h_noisy, h_clean, batch, noisy, chunk, mask_target)
    loss_ar, loss_mask = per_seq_means(ce, supervised, L)
    return loss_mask, loss_ar.detach(), loss_mask
