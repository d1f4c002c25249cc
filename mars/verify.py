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

from generate import Group, Stops, distribution, logits_at, sample, trim_at_stop
from mars.layout import Drafts, StepInputs
from model import Transformer

# Rows up to which one LM head call over every fed position costs less than two calls over the slots and
# the masks: each call reads the whole (V x C) weight, and on a CPU a bf16 head at 64 rows costs less
# than two at a few (docs/method.md §9).
HEAD_ROWS = 64


# ---- one verify step for a group of rows ----

def verify_rows(model: Transformer, h: torch.Tensor, inp: StepInputs, g: Group, mask_id: int,
                stop_ids: Stops) -> list[tuple[list[int], int, Drafts]]:
    # §9 on a group of verify rows. Slot i gives v_{i+1}: emit v_1..v_{a+1}, keep u_b and d_1..d_a in
    # the cache, and read the next drafts from the mask group after d_a.
    opts, offered = g.opts, [inp.drafts[b] for b in g.rows]  # the drafts each row feeds
    W, T = max(len(f.tokens) for f in offered) + 1, h.shape[1]
    # The LM head is the step's largest matmul after the layers, and each call reads its whole weight.
    # It runs once, over every fed position, where the slots and the next group's masks may span them
    # all (a small budget) or where they are few (HEAD_ROWS); else twice, at the slots and at the masks.
    every = logits_at(model, h, g.rows, [list(range(T))] * len(g.rows), mask_id, opts.vocab_size) \
        if T <= W + opts.B - 1 or len(g.rows) * T <= HEAD_ROWS else None

    def read(rows: list[int], idx: list[list[int]]) -> torch.Tensor:  # logits at idx of g.rows[rows]
        if every is not None:
            return every[torch.tensor(rows, device=h.device)[:, None], torch.tensor(idx, device=h.device)]
        return logits_at(model, h, [g.rows[i] for i in rows], idx, mask_id, opts.vocab_size)

    logits = read(list(range(len(g.rows))), [inp.slots(b, W) for b in g.rows])
    d = torch.tensor([f.tokens + [-1] * (W - 1 - len(f.tokens)) for f in offered], dtype=torch.long, device=h.device)
    if opts.temperature == 0 and opts.tolerance < 1.0:  # base-checked: lossy, every kept draft a near-choice
        a, tok = tolerated(distribution(logits, 0.0), d, opts.tolerance)
    elif opts.temperature == 0:
        tok = sample(logits)[0]
        a = matched(tok, d)
    else:  # the speculative-sampling rule, with the q each row's drafts were drawn from
        p = distribution(logits, opts.temperature, opts.top_p)  # (n, W, V)
        q = p.new_zeros(len(offered), W - 1, p.shape[-1])
        for i, f in enumerate(offered):
            if f.tokens:
                q[i, :len(f.tokens)] = f.q
        a, tok = speculative(p, q, d, g.generator)
    step = torch.cat([a[:, None], tok], dim=1).tolist()  # per row: a, then v_1..v_W
    a, new = [row[0] for row in step], [trim_at_stop(row[1:2 + row[0]], stop_ids) for row in step]
    start = [next_group(inp, b, a[i]) if new[i][-1] not in stop_ids else None for i, b in enumerate(g.rows)]
    drafting = [i for i, first in enumerate(start) if first is not None]
    proposed = [Drafts() for _ in g.rows]
    if drafting:
        sizes = [start[i][1] for i in drafting]
        idx = [[min(start[i][0] + j, T - 1) for j in range(max(sizes))] for i in drafting]
        probs = distribution(read(drafting, idx), opts.temperature, opts.top_p)  # (n, M, V)
        for i, drafts in zip(drafting, propose(probs, opts.temperature > 0, g.generator, sizes, opts.draft_min)):
            proposed[i] = drafts
    return [(new[i], inp.uncached[b] + a[i], proposed[i]) for i, b in enumerate(g.rows)]


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

def next_group(inp: StepInputs, b: int, a: int) -> tuple[int, int] | None:
    # (fed index of the first mask, masks) of the group after d_a, which proposes the next drafts; None
    # when the step fed no such group: a chain that accepted fewer than all of its drafts, or a budget
    # that left it out. The next step then has no drafts.
    return inp.groups[b].get(a)


def propose(probs: torch.Tensor, sampled: bool, generator: torch.Generator | None, sizes: list[int],
            draft_min: float) -> list[Drafts]:
    # probs (n, M, V): each row's distributions at the masks of its next group, the first sizes[i] of
    # them its own. Drafts are the argmax tokens, or draws when sampled; they stop at the first slot whose
    # top probability is below draft_min. The cut reads the top probability, never the drawn token's: a
    # cut that depended on the draw would change the distribution the draft comes from.
    conf, tok = probs.max(dim=-1)
    if sampled:
        for i in range(len(sizes)):
            tok[i] = torch.multinomial(probs[i], 1, generator=generator)[:, 0]
    keep = (conf >= draft_min).long().cumprod(dim=1).sum(dim=1)
    top = conf.tolist()
    proposed = torch.cat([keep[:, None], tok], dim=1).tolist()
    drafts = []
    for i, size in enumerate(sizes):
        k = min(proposed[i][0], size)
        drafts.append(Drafts(tokens=proposed[i][1:1 + k], q=probs[i, :k] if sampled else None, conf=top[i][:k]))
    return drafts
