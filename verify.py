# Self-verification (docs/method.md §9): a verify row feeds last step's drafts as ordinary tokens, keeps
# the leading drafts the model itself would have chosen, and drafts again with masks in the same forward.
# Its output is exactly the greedy output (with sampling: distributed as sequential sampling).
#
# What a verify step adds to the rule of generate.py: the drafts a row carries from step to step, the
# layout of a step's inputs (tree or chain), the acceptance of drafts (greedy and speculative), and the
# draw of the next drafts. Everything here works on token ids and distributions; generate.decode_step
# runs it on the model's logits.
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcache import KVCache

LAYOUTS = ("tree", "chain")  # a mask group for every acceptance length, or one after the drafts


@dataclass
class Drafts:
    # A verify row's proposals for the tokens after its newest emitted token.
    tokens: list[int] = field(default_factory=list)  # d_1..d_k, k <= B - 1
    q: torch.Tensor | None = None  # (k, V) the distributions they were drawn from; None when greedy


# ---- the layout of a step's inputs ----

@dataclass
class StepInputs:
    # What one forward feeds, row by row. Row b feeds u_b, its real tokens not yet in the cache (the
    # prompt at first), then its drafts d_1..d_k, then groups of w_b - 1 masks. u_b and the drafts are the
    # spine, plain causal. A threshold row (no drafts) has one group, after u_b. A verify row has one
    # after d_k (chain), or one after each of u_b, d_1, ..., d_k (tree): the group after d_a sits at the
    # positions the tokens after v_{a+1} have when exactly a drafts are accepted.
    tokens: torch.Tensor  # (R, T) ids, right-padded
    pos: torch.Tensor  # (R, T) positions
    mask: torch.Tensor | None  # (R, 1, T, S) bool, or None: plain causal without a cache
    w: list[int]  # slots row b may fill this step; 0: it sits out and feeds nothing
    uncached: list[int]  # len(u_b)
    drafts: list[Drafts | None]  # the drafts row b feeds (at most w_b - 1); None for a threshold row
    group_size: list[int]  # masks per group, w_b - 1

    def slots(self, b: int, n: int) -> list[int]:
        # The fed indices of row b's first n slots: slot i is read at u_b's last token + i. Indices past
        # the row's own are clamped into the row; their logits are never used.
        return [min(max(self.uncached[b] - 1 + i, 0), self.tokens.shape[1] - 1) for i in range(n)]


def step_inputs(seqs: list[list[int]], w: list[int], drafts: list[Drafts | None], kv: KVCache | None,
                mask_id: int, tree: list[bool], device) -> StepInputs:
    # seqs[b]: row b's prompt and output so far; drafts[b]: None for a threshold row; tree[b]: whether a
    # verify row uses the tree layout. Row b's fed token i lands in cache column kv.lengths[b] + i.
    R = len(seqs)
    lengths = kv.lengths if kv is not None else [0] * R
    verify = [w[b] > 0 and drafts[b] is not None for b in range(R)]
    fed = [Drafts(drafts[b].tokens[:w[b] - 1], None if drafts[b].q is None else drafts[b].q[:w[b] - 1])
           if verify[b] else None for b in range(R)]
    uncached = [seqs[b][lengths[b]:] if w[b] else [] for b in range(R)]
    size = [max(w[b] - 1, 0) for b in range(R)]
    rows, offset, end, groups, branches = [], [], [], [], False
    for b in range(R):
        d = fed[b].tokens if verify[b] else []
        spine = len(uncached[b]) + len(d)
        anchors = ([len(uncached[b]) - 1 + a for a in range(len(d) + 1)] if verify[b] and tree[b]
                   else [spine - 1])  # the spine index each group follows
        branches |= len(anchors) > 1 and size[b] > 0
        rows.append(uncached[b] + d + [mask_id] * (size[b] * len(anchors)))
        # A group's i-th mask sits at its anchor's position + 1 + i and sees the spine up to its anchor.
        offset.append(list(range(spine)) + [e + 1 + i for e in anchors for i in range(size[b])])
        end.append(list(range(spine)) + [e for e in anchors for _ in range(size[b])])
        groups.append([-1] * spine + [g for g in range(len(anchors)) for _ in range(size[b])])
    T = max(map(len, rows))
    tokens = torch.tensor([r + [mask_id] * (T - len(r)) for r in rows], device=device)
    # Pads are spine tokens of their own, after every real one: they see what precedes them, nobody sees them.
    fill = lambda xs: torch.tensor([r + list(range(len(r), T)) for r in xs], device=device)  # noqa: E731
    pos = torch.tensor(lengths, device=device)[:, None] + fill(offset)  # (R, T)
    S = max(lengths) + T if kv is not None else 0
    if branches:
        group = torch.tensor([g + [-1] * (T - len(g)) for g in groups], device=device)
        mask = tree_mask(lengths, fill(end), group, S)
    else:  # every row is one causal chain: fed token j of row b is at position (= cache column) lengths[b] + j
        mask = (torch.arange(S, device=device) <= pos[..., None])[:, None] if S else None  # (R, 1, T, S)
    return StepInputs(tokens, pos, mask, list(w), [len(u) for u in uncached], fed, size)


def tree_mask(lengths: list[int], end: torch.Tensor, group: torch.Tensor, S: int) -> torch.Tensor:
    # The attention mask of a step in which some row branches. end, group (R, T), per fed token: the last
    # spine index it may see, and its mask group (-1 on the spine: u, drafts, pads). A spine token sees
    # the spine up to itself; a mask sees the spine up to its group's anchor and its own group's earlier
    # masks. Every fed token sees its row's committed columns. S = max(lengths) + T with a cache, 0
    # without. Returns (R, 1, T, S or T) bool, True = may attend.
    R, T = end.shape
    j = torch.arange(T, device=end.device)
    spine = group < 0  # (R, T)
    sees = spine[:, None, :] & (j <= end[..., None])  # (R, T query, T key): spine keys up to the anchor
    sees |= (group[:, None, :] == group[..., None]) & ~spine[:, None, :] & (j <= j[:, None])  # own group
    if not S:
        return sees[:, None]
    col = torch.arange(S, device=end.device) - torch.tensor(lengths, device=end.device)[:, None]  # (R, S)
    fed = sees.gather(2, col.clamp(0, T - 1)[:, None].expand(R, T, S)) & ((col >= 0) & (col < T))[:, None]
    return ((col < 0)[:, None] | fed)[:, None]


# ---- accepting drafts ----

def matched(tok: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    # Greedy verify. tok (n, W): the greedy tokens v_1..v_W; d (n, W-1): the drafts, -1 past a row's.
    # Returns a (n,): the leading drafts equal to v. The row emits v_1..v_{a+1}, all greedy tokens.
    return (tok[:, :-1] == d).long().cumprod(dim=1).sum(dim=1)


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

def next_group(inp: StepInputs, b: int, a: int, tree: bool) -> int | None:
    # The fed index of the first mask of the group after d_a, which proposes the next drafts; None when
    # there is none: a row without masks, or a chain that accepted fewer than all of its drafts.
    k = len(inp.drafts[b].tokens)
    if not inp.group_size[b] or not tree and a < k:
        return None
    return inp.uncached[b] + k + (a if tree else 0) * inp.group_size[b]


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
    proposed = torch.cat([keep[:, None], tok], dim=1).tolist()
    drafts = []
    for i, size in enumerate(sizes):
        k = min(proposed[i][0], size)
        drafts.append(Drafts(proposed[i][1:1 + k], probs[i, :k] if sampled else None))
    return drafts
