# Self-verification (docs/method.md §9): a verify row feeds last step's drafts as ordinary tokens, keeps
# the leading drafts the model itself would have chosen, and drafts again with masks in the same forward.
# Its output is exactly the greedy output (with sampling: distributed as sequential sampling).
#
# What a verify step adds to the rule of generate.py: the acceptance of drafts (greedy, base-checked and
# speculative) and the draw of the next drafts, on a step laid out by mars/layout.py. generate.decode_step
# loads this file where a group of rows verifies and runs verify_rows on the model's hidden states.
from __future__ import annotations

import torch
import torch.nn.functional as F

from generate import Group, Stops, allowed, distribution, sample, trim_at_stop
from mars.layout import Drafts, StepInputs
from model import Transformer

# Rows up to which one LM head call over every fed position costs less than two calls over the slots and
# the masks: each call reads the whole (V x C) weight, and on a CPU a bf16 head at 64 rows costs less
# than two at a few (docs/method.md §9).
HEAD_ROWS = 64


# ---- one verify step for a group of rows ----

def verify_rows(model: Transformer, h: torch.Tensor, inp: StepInputs, g: Group, mask_id: int,
                stop_ids: Stops) -> list[tuple[list[int], int, Drafts, int]]:
    # §9 on a group of verify rows. Slot i gives v_{i+1}: emit v_1..v_{a+1}, keep u_b and d_1..d_a in
    # the cache, and read the next drafts from the mask group after d_a. The step reads the device once,
    # at its end: the group after d_a is picked on the device, where a is.
    opts, offered = g.opts, [inp.drafts[b] for b in g.rows]  # the drafts each row feeds
    n, W, T = len(g.rows), max(len(f.tokens) for f in offered) + 1, h.shape[1]
    M = max((m for b in g.rows for _, m in inp.groups[b].values()), default=0)  # the largest group's masks
    # One copy to the device, per row: its row of h, its W slots, its drafts (-1 past them), then for each
    # a = 0..W-1 the fed indices of the M masks after d_a (clamped into the row) and how many are its own.
    x = torch.tensor([[b] + inp.slots(b, W) + f.tokens + [-1] * (W - 1 - len(f.tokens)) + groups(inp, b, W, M, T)
                      for b, f in zip(g.rows, offered)]).to(h.device, non_blocking=True)
    r, slots, d, after = x[:, :1], x[:, 1:W + 1], x[:, W + 1:2 * W], x[:, 2 * W:].view(n, W, M + 1)
    # The LM head is the step's largest matmul after the layers, and each call reads its whole weight.
    # It runs once, over every fed position, where the slots and the next group's masks may span them
    # all (a small budget) or where they are few (HEAD_ROWS); else twice, at the slots and at the masks.
    every = allowed(model.head(h[r[:, 0]]), mask_id, opts.vocab_size) \
        if T <= W + opts.B - 1 or n * T <= HEAD_ROWS else None

    def read(idx: torch.Tensor) -> torch.Tensor:  # the allowed logits (n, m, V) at fed indices idx (n, m)
        if every is not None:
            return every[torch.arange(n, device=h.device)[:, None], idx]
        return allowed(model.head(h[r, idx]), mask_id, opts.vocab_size)

    logits = read(slots)
    if opts.temperature == 0 and opts.tolerance < 1.0:  # base-checked: lossy, every kept draft a near-choice
        a, tok = tolerated(distribution(logits, 0.0), d, opts.tolerance)
    elif opts.temperature == 0:
        tok = sample(logits)[0]
        a = matched(tok, d)
    else:  # the speculative-sampling rule, with the q each row's drafts were drawn from
        p = distribution(logits, opts.temperature, opts.top_p)  # (n, W, V)
        q = p.new_zeros(n, W - 1, p.shape[-1])
        for i, f in enumerate(offered):
            if f.tokens:
                q[i, :len(f.tokens)] = f.q
        a, tok = speculative(p, q, d, g.generator)
    back = [a[:, None], tok]  # what the host reads, in one copy
    if M:  # every row drafts from the group after its d_a; a row that has none, or stops, drops them
        pick = after[torch.arange(n, device=h.device), a]  # (n, M + 1)
        probs = distribution(read(pick[:, :M]), opts.temperature, opts.top_p)  # (n, M, V)
        conf, drafted = propose(probs, opts.temperature > 0, g.generator)
        back += [pick[:, M:], drafted, conf]
    # The one device sync of a verify step. Ids, counts and float32 confidences are exact in float64.
    step = torch.cat([t.double() for t in back], dim=1).tolist()
    rows = []
    for i, (b, row) in enumerate(zip(g.rows, step)):  # row: a, v_1..v_W, then the group's size, drafts, confs
        a_i = int(row[0])
        new, drafts = trim_at_stop([int(t) for t in row[1:a_i + 2]], stop_ids), Drafts()
        if M and new[-1] not in stop_ids:
            size, tokens, conf = int(row[W + 1]), row[W + 2:W + 2 + M], row[W + 2 + M:]
            k = cut(conf[:size], opts.draft_min)
            drafts = Drafts(tokens=[int(t) for t in tokens[:k]], q=probs[i, :k] if opts.temperature > 0 else None,
                            conf=conf[:k])
        rows.append((new, inp.uncached[b] + a_i, drafts, min(a_i, len(new))))  # a stop may end the drafts emitted
    return rows


def groups(inp: StepInputs, b: int, W: int, M: int, T: int) -> list[int]:
    # For a = 0..W-1: the fed indices of the M masks after d_a, clamped into the row, then how many of
    # them are the group's (0 where the step fed none: a chain that accepted fewer than all of its drafts,
    # or a budget that left it out; the next step then has no drafts).
    out = []
    for a in range(W):
        first, m = inp.groups[b].get(a, (T - 1, 0))
        out += [min(first + j, T - 1) for j in range(M)] + [m]
    return out


# ---- accepting drafts ----

def matched(tok: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    # Greedy verify. tok (n, W): the greedy tokens v_1..v_W; d (n, W-1): the drafts, -1 past a row's.
    # Returns a (n,): the leading drafts equal to v. The row emits v_1..v_{a+1}, all greedy tokens.
    return (tok[:, :-1] == d).long().cumprod(dim=1).sum(dim=1)


def tolerated(p: torch.Tensor, d: torch.Tensor, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Base-checked verify, lossy. p (n, W, V): the AR distributions at u's last token and at d_1..d_{W-1};
    # d (n, W-1): the drafts, -1 past a row's. Keep d_i, left to right, while p_i(d_i) >= tolerance *
    # max p_i: a token the model itself rates near its first choice. Returns a (n,) and tok (n, W):
    # d_1..d_a, then the argmax after them, so every emitted token is one the base model rated so.
    top, greedy = p.max(dim=-1)  # (n, W)
    pd = p[:, :-1].gather(-1, d.clamp(min=0)[..., None])[..., 0]  # (n, W-1)
    a = ((d >= 0) & (pd >= tolerance * top[:, :-1])).long().cumprod(dim=1).sum(dim=1)
    kept = torch.arange(p.shape[1], device=p.device) < a[:, None]
    return a, torch.where(kept, F.pad(d, (0, 1)), greedy)


def speculative(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # Sampled verify. p (n, W, V): the verifying distributions at the last token of u and at
    # d_1..d_{W-1}; q (n, W-1, V): the distributions the drafts were drawn from, zero rows past a row's
    # drafts; d (n, W-1): the drafts, -1 past them. Accept d_i with probability min(1, p(d_i) / q(d_i)),
    # left to right; at the first rejection draw from normalise(max(0, p - q)) instead, and after the last
    # draft from p itself (q = 0 there). Returns a (n,), drafts accepted, and tok (n, W): d_1..d_a, then
    # that one draw at index a. Every emitted token is distributed as sequential sampling from p.
    n, W = p.shape[:2]
    idx = d.clamp(min=0)[..., None]  # (n, W-1, 1)
    pd, qd = p[:, :-1].gather(-1, idx)[..., 0], q.gather(-1, idx)[..., 0]  # (n, W-1)
    r = torch.rand(pd.shape, generator=generator, device=p.device)
    passes = (d >= 0) & (r * qd < pd)  # r < p/q, without dividing: q(d) > 0 since d was drawn from q
    a = passes.long().cumprod(dim=1).sum(dim=1)
    residual = (p - F.pad(q, (0, 0, 0, 1))).clamp(min=0)  # (n, W, V); the pad row: p after the last draft
    # Where p <= q everywhere (p == q) the draft is never rejected, but the draw must still be valid.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    draw = torch.multinomial(residual.flatten(0, 1), 1, generator=generator).view(n, W)
    kept = torch.arange(W, device=p.device) < a[:, None]
    return a, torch.where(kept, F.pad(d, (0, 1)), draw)


# ---- the next drafts ----

def propose(probs: torch.Tensor, sampled: bool, generator: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    # probs (n, M, V): each row's distributions at the masks of its next group. Returns each slot's top
    # probability and its draft: the argmax token, or a draw when sampled.
    conf, tok = probs.max(dim=-1)
    if sampled:
        for i in range(probs.shape[0]):
            tok[i] = torch.multinomial(probs[i], 1, generator=generator)[:, 0]
    return conf, tok


def cut(conf: list[float], draft_min: float) -> int:
    # Drafts stop at the first slot whose top probability is below draft_min, compared in float32 as the
    # probabilities are. The cut reads the top probability, never the drawn token's: a cut that depended on
    # the draw would change the distribution the draft comes from.
    draft_min, k = float(torch.tensor(draft_min, dtype=torch.float32)), 0
    while k < len(conf) and conf[k] >= draft_min:
        k += 1
    return k
