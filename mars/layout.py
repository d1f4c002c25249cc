# The layout of a decode step's inputs (docs/method.md §6, §9): what each row feeds to one forward, at
# which positions, seeing which keys. A threshold row feeds its new tokens and one group of masks; a
# verify row also carries drafts from step to step, and feeds them with a mask group after each (tree)
# or after the last (chain), as many as its draft budget keeps. generate.decode_step builds every step
# here; mars/verify.py reads a verify row's slots and groups back out of it.
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache import KVCache

LAYOUTS = ("tree", "chain")  # a mask group for every acceptance length, or one after the drafts
# The largest B the decoding scripts take: a verify row's full tree feeds B^2 positions, and the draft budget's
# choice weighs each of its B^2 - 1 sizes.
MAX_BLOCK_SIZE = 32


def check_block_size(B: int) -> None:  # a usage error for --block-size B (0: the checkpoint's own)
    if not 0 <= B <= MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size {B} must be in 1..{MAX_BLOCK_SIZE} (or 0: the checkpoint's own); a verify "
                         "step's full tree feeds B^2 positions a row")


# ---- a verify row's drafts and its draft budget ----

@dataclass
class Drafts:
    # A verify row's proposals for the tokens after its newest emitted token.
    tokens: list[int] = field(default_factory=list)  # d_1..d_k, k <= B - 1
    q: torch.Tensor | None = None  # (k, V) the distributions they were drawn from; None when greedy
    conf: list[float] = field(default_factory=list)  # each draft's slot's top probability: the budget's gains


def acceptance(conf: list[float]) -> tuple[list[float], list[float]]:
    # conf: c_1..c_k, the chance that each draft is accepted once the ones before it are. Returns run,
    # run[i] = c_1 ... c_i (d_1..d_i all accepted), and exactly, exactly[a] = P(exactly a accepted).
    run = [1.0]
    for c in conf:
        run.append(run[-1] * c)
    return run, [run[a] * (1 - conf[a]) for a in range(len(conf))] + [run[-1]]


def budget_layout(conf: list[float], G: int, budget: int) -> tuple[int, list[int]]:
    # The draft budget. conf: c_1..c_k, a verify row's draft confidences; G: the masks of a whole group
    # (B - 1); budget: the positions drafts and masks may take (0: no limit, the full tree). Returns
    # (k', sizes): feed d_1..d_k', then after each d_a (a = 0..k') sizes[a] masks. It keeps the `budget`
    # positions of largest expected gain: draft i gains the chance that d_1..d_i are all accepted,
    # c_1 ... c_i; mask m of the group after d_a is used only when exactly a drafts are accepted, and its
    # proposal is then accepted with about the chance that this step's first m drafts are.
    k = len(conf)
    if not budget:
        return k, [G] * (k + 1)
    kept = ranked_positions(conf, G)[:budget]
    drafts = max((i for _, kind, i, _ in kept if kind == 0), default=0)
    sizes = [0] * (drafts + 1)
    for _, kind, a, m in kept:
        if kind == 1 and a <= drafts:
            sizes[a] = max(sizes[a], m)
    return drafts, sizes


def ranked_positions(conf: list[float], G: int) -> list[tuple[float, int, int, int]]:
    # Every draft and mask a verify row could feed, by expected gain, largest first: (gain, 0, i, 0) for draft
    # d_i, (gain, 1, a, m) for mask m of the group after d_a. A budget of N keeps the first N.
    k = len(conf)
    run, exactly = acceptance(conf)
    ahead = run[1:] + [run[-1] * (conf[-1] if conf else 1.0) ** (m + 1) for m in range(G - k)]
    gains = [(run[i], 0, i, 0) for i in range(1, k + 1)]  # (gain, drafts first on ties, which)
    gains += [(exactly[a] * ahead[m], 1, a, m + 1) for a in range(k + 1) for m in range(G)]
    return sorted(gains, key=lambda x: (-x[0], x[1], x[2], x[3]))


# ---- the layout of a step's inputs ----

@dataclass
class StepInputs:
    # What one forward feeds, row by row. Row b feeds u_b, its real tokens not yet in the cache (the
    # prompt at first), then its drafts d_1..d_k, then groups of w_b - 1 masks. u_b and the drafts are the
    # spine, plain causal. A threshold row (no drafts) has one group, after u_b. A verify row has one
    # after d_k (chain), or one after each of u_b, d_1, ..., d_k (tree; within a draft budget, the groups
    # and drafts budget_layout keeps): the group after d_a starts at v_{a+1}'s position, in its place when
    # exactly a drafts are accepted, and its outputs are the tokens after v_{a+1} (§9).
    tokens: torch.Tensor  # (R, T) ids, right-padded
    pos: torch.Tensor  # (R, T) positions
    mask: torch.Tensor | None  # (R, 1, T, S) bool, or None: plain causal without a cache
    w: list[int]  # slots row b may fill this step; 0: it sits out and feeds nothing
    uncached: list[int]  # len(u_b)
    drafts: list[Drafts | None]  # the drafts row b feeds (at most w_b - 1); None for a threshold row
    groups: list[dict[int, tuple[int, int]]]  # row b: a -> (fed index of the first mask after d_a, masks)
    fed: list[int]  # positions row b feeds: u_b, drafts and masks

    def slots(self, b: int, n: int) -> list[int]:
        # The fed indices of row b's first n slots: slot i is read at u_b's last token + i. Indices past
        # the row's own are clamped into the row; their logits are never used.
        return [min(max(self.uncached[b] - 1 + i, 0), self.tokens.shape[1] - 1) for i in range(n)]


def group_sizes(drafts: Drafts | None, w: int, tree: bool, budget: int) -> tuple[Drafts | None, dict[int, int]]:
    # The drafts a row feeds and its mask groups, a -> masks after d_a (a = 0 follows u_b).
    G = max(w - 1, 0)
    if drafts is None or not w:  # a threshold row, or one that sits out
        return None, {0: G} if G else {}
    k = min(len(drafts.tokens), G)
    if tree:  # drafts made without confidences (a test's forced drafts) count as sure
        k, sizes = budget_layout((drafts.conf + [1.0] * k)[:k], G, budget)
        groups = {a: n for a, n in enumerate(sizes) if n}
    else:
        groups = {k: G} if G else {}
    q = None if drafts.q is None else drafts.q[:k]
    return Drafts(tokens=drafts.tokens[:k], q=q, conf=drafts.conf[:k]), groups


def step_inputs(seqs: list[list[int]], w: list[int], drafts: list[Drafts | None], kv: KVCache | None,
                mask_id: int, tree: list[bool], device, budget: list[int] | None = None) -> StepInputs:
    # seqs[b]: row b's prompt and output so far; drafts[b]: None for a threshold row; tree[b]: whether a
    # verify row uses the tree layout, within budget[b] positions (0: the full tree). Row b's fed token i
    # lands in cache column kv.lengths[b] + i.
    R = len(seqs)
    lengths = kv.lengths if kv is not None else [0] * R
    laid = [group_sizes(drafts[b], w[b], tree[b], budget[b] if budget else 0) for b in range(R)]
    offered = [d for d, _ in laid]  # the drafts each row feeds
    uncached = [seqs[b][lengths[b]:] if w[b] else [] for b in range(R)]
    rows, offset, end, groups, starts, branches = [], [], [], [], [], False
    for b, (f, sizes) in enumerate(laid):
        d = f.tokens if f is not None else []
        spine = len(uncached[b]) + len(d)
        masks = [(a, i) for a, n in sizes.items() for i in range(n)]
        branches |= any(a != len(d) for a in sizes)
        rows.append(uncached[b] + d + [mask_id] * len(masks))
        # The i-th mask after d_a sits at d_a's position + 1 + i and sees the spine up to d_a.
        offset.append(list(range(spine)) + [len(uncached[b]) + a + i for a, i in masks])
        end.append(list(range(spine)) + [len(uncached[b]) - 1 + a for a, _ in masks])
        groups.append([-1] * spine + [a for a, _ in masks])
        starts.append({a: (spine + masks.index((a, 0)), n) for a, n in sizes.items()})
    T = max(map(len, rows))
    # Pads are spine tokens of their own, after every real one: they see what precedes them, nobody sees them.
    fill = lambda r: r + list(range(len(r), T))  # noqa: E731
    # One copy to the device, no sync: per row its tokens, offsets, ends and groups (T each), then its length.
    x = torch.tensor([r + [mask_id] * (T - len(r)) + fill(o) + fill(e) + g + [-1] * (T - len(g)) + [n]
                      for r, o, e, g, n in zip(rows, offset, end, groups, lengths)]).to(device, non_blocking=True)
    tokens, offset, end, group = x[:, :4 * T].view(R, 4, T).unbind(1)
    pos = x[:, 4 * T:] + offset  # (R, T)
    S = max(lengths) + T if kv is not None else 0
    if branches:
        mask = tree_mask(x[:, 4 * T:], end, group, S)
    else:  # every row is one causal chain: fed token j of row b is at position (= cache column) lengths[b] + j
        mask = (torch.arange(S, device=device) <= pos[..., None])[:, None] if S else None  # (R, 1, T, S)
    return StepInputs(tokens=tokens, pos=pos, mask=mask, w=list(w), uncached=[len(u) for u in uncached],
                      drafts=offered, groups=starts, fed=list(map(len, rows)))


def tree_mask(lengths: torch.Tensor, end: torch.Tensor, group: torch.Tensor, S: int) -> torch.Tensor:
    # The attention mask of a step in which some row branches. lengths (R, 1): each row's committed
    # entries; end, group (R, T), per fed token: the last spine index it may see, and its mask group (-1
    # on the spine: u, drafts, pads). A spine token sees the spine up to itself; a mask sees the spine up
    # to its group's anchor and its own group's earlier masks. Every fed token sees its row's committed
    # columns. S = max(lengths) + T with a cache, 0 without. Returns (R, 1, T, S or T) bool, True = may
    # attend.
    R, T = end.shape
    j = torch.arange(T, device=end.device)
    spine = group < 0  # (R, T)
    sees = spine[:, None, :] & (j <= end[..., None])  # (R, T query, T key): spine keys up to the anchor
    sees |= (group[:, None, :] == group[..., None]) & ~spine[:, None, :] & (j <= j[:, None])  # own group
    if not S:
        return sees[:, None]
    col = torch.arange(S, device=end.device) - lengths  # (R, S)
    fed = sees.gather(2, col.clamp(0, T - 1)[:, None].expand(R, T, S)) & ((col >= 0) & (col < T))[:, None]
    return ((col < 0)[:, None] | fed)[:, None]


# ---- what a decode counts ----

@dataclass
class Stats:
    # What decode() counts, one entry per prompt. offered / accepted: drafts fed for checking and the drafts
    # among the tokens a step emits (verify), so that a reply's tokens are its forwards plus its accepted drafts,
    # less one where it ends on a stop token accepted as a draft; positions / steps: positions fed and forwards,
    # after the prompt's forward (threshold rows and the block cache too).
    offered: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


def count(stats: Stats, b: int, k: int, a: int) -> None:
    # Row b fed its first k drafts and accepted a of them.
    stats.offered[b] += k
    stats.accepted[b] += a
