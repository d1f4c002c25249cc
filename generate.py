# MARS decoding (docs/method.md §6) with three KV-cache strategies (§7), lossless self-verification (§9),
# sampling, and a CLI.
#
# Each step appends mask tokens after the committed text and runs one causal forward. Slot 0 is the
# ordinary next-token prediction from the last real token; slot i > 0 comes from the (i-1)-th mask.
# Threshold decoding accepts slot 0 always, later slots left to right while their confidence is >= tau.
# Verify decoding feeds last step's mask proposals as ordinary tokens and keeps those the model itself
# would have chosen, so its output is exactly the greedy (tau = 1) output at several tokens per forward.
#
#   python generate.py --ckpt runs/demo/mars --prompt "What is 12 + 7?" --threshold 0.9
#   python generate.py --ckpt runs/demo/mars --prompt "What is 12 + 7?" --verify
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.nn.functional as F

import cli
from checkpoint import (
    DEFAULT_CKPT,
    check_checkpoint,
    device_and_dtype,
    load_model,
    trained_block_size,
    warn_untrained_masks,
)
from files import jsonl
from kvcache import KVCache
from model import Transformer
from tokenizer import Tokenizer

DEFAULT_TAU = 0.9  # --threshold when none is given
CACHES = ("none", "step", "cursor", "block")
LAYOUTS = ("tree", "chain")  # verify: a mask group for every acceptance length, or one after the drafts (§9)
Stops = set[int] | frozenset[int]  # token ids that end a row: <|im_end|>, <|endoftext|>
OnAccept = Callable[[int, list[int]], None]  # (row, tokens accepted this step), for streaming


# ---- one step: candidates, confidences, acceptance ----

def distribution(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    # logits (..., V) -> probabilities (..., V) in float32 after temperature and the top-p nucleus:
    # what a sampled token is drawn from (and, in verify mode, what p and q of §9 are).
    probs = torch.softmax(logits.float() / (temperature or 1.0), dim=-1)
    if top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p, then renormalise
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # logits (..., V) -> token (...), confidence (...): the token's probability in float32 (§6.3).
    if temperature == 0:
        conf, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)  # greedy: the paper's setting
        return tok, conf
    probs = distribution(logits, temperature, top_p)
    tok = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(probs.shape[:-1])
    return tok, probs.gather(-1, tok[..., None])[..., 0]


def accept_count(conf: torch.Tensor, tau: float | list[float]) -> torch.Tensor:
    # conf (R, W) -> accepted slots per row (R,): slot 0 always, then while conf >= tau (§6.4).
    # tau: one threshold, or one per row (a server mixes requests with their own thresholds).
    # tau == 1.0 is one token per step by rule: a bf16 probability can round to exactly 1.0.
    taus = [tau] * conf.shape[0] if isinstance(tau, (int, float)) else list(tau)
    if min(taus) >= 1.0 or conf.shape[1] == 1:
        return torch.ones(conf.shape[0], dtype=torch.long, device=conf.device)
    t = torch.tensor(taus, dtype=conf.dtype, device=conf.device)[:, None]  # (R, 1)
    ok = (conf[:, 1:] >= t) & (t < 1.0)
    return 1 + ok.long().cumprod(dim=1).sum(dim=1)


def allowed(logits: torch.Tensor, mask_id: int, vocab_size: int | None) -> torch.Tensor:
    # Candidates are real tokens: not the mask (an input symbol only), not the spare embedding rows
    # past the tokenizer's vocabulary, which it cannot decode.
    logits = logits[..., :vocab_size]
    logits[..., mask_id] = float("-inf")
    return logits


def trim_at_stop(tokens: list[int], stop_ids: Stops) -> list[int]:
    # Keep up to and including the first stop token: what a step accepted after EOS is dropped.
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


def window(n_out: int, B: int, max_new_tokens: int, block: int) -> int:
    # How many slots a row may fill this step: B, capped by the token budget and, with block = K > 0,
    # by the end of the row's current K-token output block (§7: a step never accepts past it).
    end = (n_out // block + 1) * block if block else max_new_tokens
    return min(n_out + B, max_new_tokens, end) - n_out


def speculative(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # The speculative-sampling rule of §9, for sampled verify rows. p (R, W, V): the verifying
    # distributions at the last token of u and at d_1..d_{W-1}; q (R, W-1, V): the distributions the
    # drafts were drawn from, zero rows past a row's drafts; d (R, W-1): the drafts, -1 past them.
    # Accept d_i with probability min(1, p(d_i) / q(d_i)), left to right; at the first rejection draw
    # from normalise(max(0, p - q)) instead, and after the last draft from p itself (q = 0 there).
    # Returns a (R,), drafts accepted, and tok (R, W): d_1..d_a, then that one draw at index a.
    # Every emitted token is then distributed as sequential sampling from p would give it.
    R, W = p.shape[:2]
    dd = d.clamp(min=0)[..., None]  # (R, W-1, 1)
    pd, qd = p[:, :-1].gather(-1, dd)[..., 0], q.gather(-1, dd)[..., 0]  # (R, W-1)
    r = torch.rand(pd.shape, generator=generator, device=p.device)
    ok = (d >= 0) & (r * qd < pd)  # r < p/q, without dividing: q(d) > 0 since d was drawn from q
    a = ok.long().cumprod(dim=1).sum(dim=1)
    resid = (p - F.pad(q, (0, 0, 0, 1))).clamp(min=0)  # (R, W, V); the pad row: p after the last draft
    # Where p <= q everywhere (p == q) the draft is never rejected, but the draw must still be valid.
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
    fix = torch.multinomial(resid.flatten(0, 1), 1, generator=generator).view(R, W)
    kept = torch.arange(W, device=p.device) < a[:, None]
    return a, torch.where(kept, F.pad(d, (0, 1)), fix)


@dataclass
class Drafts:
    # A verify row's proposals for the tokens after its newest emitted token (docs/method.md §9).
    tokens: list[int] = field(default_factory=list)  # d_1..d_k, k <= B - 1
    q: torch.Tensor | None = None  # (k, V) the distributions they were drawn from; None when greedy


# ---- the reference: the uncached sliding window, one sequence (§6) ----

@torch.inference_mode()
def decode_naive(model: Transformer, prompt: list[int], mask_id: int, stop_ids: Stops,
                 tau: float = 0.9, B: int = 4, max_new_tokens: int = 256,
                 block: int = 0, vocab_size: int | None = None) -> tuple[list[int], int]:
    # Re-runs prompt + output + B masks every step, plain causal. Every cache mode must reproduce
    # its tokens exactly (greedy, float32); `block` adds the block-cache boundaries of §7.
    out, forwards = [], 0
    while len(out) < max_new_tokens and not (out and out[-1] in stop_ids):
        c = len(prompt) + len(out)
        x = torch.tensor([prompt + out + [mask_id] * B], device=model.model.embed_tokens.weight.device)
        logits = model(x)[:, c - 1:c + B - 1]  # slot i from position c + i - 1; (1, B, V)
        tok, conf = sample(allowed(logits, mask_id, vocab_size))
        n = min(accept_count(conf, tau).item(), window(len(out), B, max_new_tokens, block))
        out += trim_at_stop(tok[0, :n].tolist(), stop_ids)
        forwards += 1
    return out, forwards


# ---- batched decoding: threshold (§6) and verify (§9) rows, none, cursor and block caches (§7) ----

def tree_mask(lengths: list[int], end: torch.Tensor, group: torch.Tensor, S: int) -> torch.Tensor:
    # The attention mask of a step in which some row branches (§9's tree layout). end, group (R, T), per
    # fed token: the last spine index it may see, and its mask group (-1 on the spine: u, drafts, pads).
    # A spine token sees the spine up to itself; a mask sees the spine up to its group's anchor and its
    # own group's earlier masks. Row b's fed token i lands in cache column lengths[b] + i, after the
    # row's committed columns, which every token sees. S = max(lengths) + T with a cache, 0 without.
    # Returns (R, 1, T, S or T) bool, True = may attend.
    R, T = end.shape
    j = torch.arange(T, device=end.device)
    spine = group < 0  # (R, T)
    vis = spine[:, None, :] & (j <= end[..., None])  # (R, T query, T key): spine keys up to the anchor
    vis |= (group[:, None, :] == group[..., None]) & ~spine[:, None, :] & (j <= j[:, None])  # own group
    if not S:
        return vis[:, None]
    rel = torch.arange(S, device=end.device) - torch.tensor(lengths, device=end.device)[:, None]  # (R, S)
    fed = vis.gather(2, rel.clamp(0, T - 1)[:, None].expand(R, T, S)) & ((rel >= 0) & (rel < T))[:, None]
    return ((rel < 0)[:, None] | fed)[:, None]


@dataclass(frozen=True)
class Options:
    # How a step picks its tokens. tau and temperature: one value, or a tuple with one per row (a server
    # mixes requests with their own). layout and draft_min only matter to verify rows (§9).
    tau: float | tuple[float, ...] = 0.9  # threshold rows accept slots 1.. while confidence >= tau (§6)
    temperature: float | tuple[float, ...] = 0.0  # 0 = greedy
    top_p: float = 1.0  # sampling: the nucleus
    layout: str = "tree"  # verify: a mask group per acceptance length (tree) or one after the drafts (chain)
    draft_min: float = 0.0  # verify: drafts stop at the first slot whose confidence is below this
    vocab_size: int | None = None  # logits past it (spare embedding rows) never compete

    def temperatures(self, R: int) -> list[float]:
        t = self.temperature
        return [t] * R if isinstance(t, (int, float)) else list(t)


class Generators:
    # The random draws of a step: one generator for the whole batch, or one per row (serve.py's
    # per-request seed: a row's draws then depend on its own generator and its own slots alone).
    def __init__(self, generator: torch.Generator | list[torch.Generator | None] | None):
        self.per_row = isinstance(generator, list)
        self.generator = generator

    def of(self, b: int) -> torch.Generator | None:
        return self.generator[b] if self.per_row else self.generator

    def each(self, rows: list[int]):
        # The draws to make: (rows, generator) pairs; per row when rows have their own generators.
        if self.per_row:
            return [([b], self.generator[b]) for b in rows]
        return [(rows, self.generator)] if rows else []


@dataclass
class StepInputs:
    # What one forward feeds, row by row (§6 for threshold rows, §9 for verify rows). Row b feeds u_b,
    # its real tokens not yet in the cache (the prompt at first), then its drafts d_1..d_k, then groups
    # of w_b - 1 masks (the w_b-th mask of §6 would only feed the unused last logit). u_b and the drafts
    # are the spine, plain causal. A threshold row has one group, after u_b. A verify row has one after
    # d_k (chain), or one after each of u_b, d_1, ..., d_k (tree): the group after d_a stands in for the
    # tokens that follow when exactly a drafts are accepted, at the positions they would have.
    tokens: torch.Tensor  # (R, T) ids, right-padded
    pos: torch.Tensor  # (R, T) positions
    mask: torch.Tensor | None  # (R, 1, T, S) bool, or None: plain causal without a cache
    real: list[int]  # len(u_b)
    drafts: list[list[int]]  # d_b
    verify: list[bool]  # whether row b is a verify row this step
    group: list[int]  # masks per group, w_b - 1 (0 for a row that sits out)


def step_inputs(seqs: list[list[int]], w: list[int], drafts: list[Drafts | None], lengths: list[int],
                mask_id: int, layout: str, cached: bool, device) -> StepInputs:
    # Stage 1 of a step: the tokens, positions and attention mask every row feeds (see StepInputs).
    R = len(seqs)
    verify = [w[b] > 0 and drafts[b] is not None for b in range(R)]
    real = [seqs[b][lengths[b]:] if w[b] else [] for b in range(R)]
    d = [drafts[b].tokens[:w[b] - 1] if verify[b] else [] for b in range(R)]
    spine = [len(real[b]) + len(d[b]) for b in range(R)]
    group = [max(w[b] - 1, 0) for b in range(R)]
    anchors = [[len(real[b]) - 1 + a for a in range(len(d[b]) + 1)] if verify[b] and layout == "tree"
               else [spine[b] - 1] for b in range(R)]  # the spine index each group follows
    rows, offset, end, groups = [], [], [], []
    for b in range(R):  # a group's i-th mask sits at (its anchor's position) + 1 + i
        rows.append(real[b] + d[b] + [mask_id] * (group[b] * len(anchors[b])))
        offset.append(list(range(spine[b])) + [e + 1 + i for e in anchors[b] for i in range(group[b])])
        end.append(list(range(spine[b])) + [e for e in anchors[b] for _ in range(group[b])])
        groups.append([-1] * spine[b] + [g for g in range(len(anchors[b])) for _ in range(group[b])])
    T = max(map(len, rows))
    tokens = torch.tensor([r + [mask_id] * (T - len(r)) for r in rows], device=device)
    # Pads are spine tokens of their own, after every real one: they see what precedes them, nobody sees them.
    fill = lambda xs: torch.tensor([r + list(range(len(r), T)) for r in xs], device=device)  # noqa: E731
    pos = torch.tensor(lengths, device=device)[:, None] + fill(offset)  # (R, T)
    if any(len(anchors[b]) > 1 and group[b] for b in range(R)):
        g = torch.tensor([x + [-1] * (T - len(x)) for x in groups], device=device)
        mask = tree_mask(lengths, fill(end), g, max(lengths) + T if cached else 0)
    else:  # every row is one causal chain: query j of row b is at position (= cache column) lengths[b] + j
        mask = None if not cached else (
            torch.arange(max(lengths) + T, device=device) <= pos[..., None])[:, None]  # (R, 1, T, S)
    return StepInputs(tokens, pos, mask, [len(u) for u in real], d, verify, group)


def at(model: Transformer, h: torch.Tensor, idx: list[list[int]], mask_id: int, vocab_size: int | None):
    # The allowed logits (R, n, V) at the fed positions idx[b] of each row: the LM head runs there only.
    i = torch.tensor(idx, device=h.device)[..., None].expand(-1, -1, h.shape[-1])
    return allowed(model.head(h.gather(1, i)), mask_id, vocab_size)


def accept(logits: torch.Tensor, inp: StepInputs, w: list[int], opts: Options, gens: Generators,
           drafts: list[Drafts | None], stop_ids: Stops) -> tuple[list[list[int]], list[int], list[int]]:
    # Stage 2 of a step. logits (R, W, V): row b's slot i, read at spine index real_b - 1 + i: a threshold
    # row's w_b slots of §6, a verify row's k_b + 1 verifying logits (§9 step 1: slot i gives v_{i+1}).
    # Returns the tokens each row emits (cut after a stop token; [] for a row that sat out), how many of
    # the tokens it fed are now a verified prefix (what a cursor cache commits: u_b plus the accepted
    # drafts), and how many slots it accepted.
    R, W, device = logits.shape[0], logits.shape[1], logits.device
    temps = opts.temperatures(R)
    tok, conf = sample(logits)  # greedy rows take the argmax
    hot = [b for b in range(R) if temps[b] > 0 and not inp.verify[b]]  # sampled threshold rows
    for rows, g in gens.each(hot):
        if gens.per_row:  # a row's draws depend on its own generator and its own w_b slots
            b = rows[0]
            tok[b, :w[b]], conf[b, :w[b]] = sample(logits[b, :w[b]].float() / temps[b], 1.0, opts.top_p, g)
        else:
            t = torch.tensor([temps[b] for b in rows], device=device)[:, None, None]
            tok[rows], conf[rows] = sample(logits[rows].float() / t, 1.0, opts.top_p, g)
    n = accept_count(conf, opts.tau)
    if any(inp.verify):
        # Greedy: a = the leading drafts equal to the greedy tokens; emit v_1..v_{a+1}, all greedy tokens.
        d = torch.tensor([x + [-1] * (W - 1 - len(x)) for x in inp.drafts], dtype=torch.long, device=device)
        a = (tok[:, :W - 1] == d).long().cumprod(dim=1).sum(dim=1)
        spec = [b for b in range(R) if inp.verify[b] and temps[b] > 0]
        if spec:  # sampled verify rows: the speculative-sampling rule, with the q their drafts were drawn from
            t = torch.tensor([temps[b] for b in spec], device=device)[:, None, None]
            p = distribution(logits[spec].float() / t, 1.0, opts.top_p)  # (n, W, V)
            q = p.new_zeros(len(spec), W - 1, p.shape[-1])
            for i, b in enumerate(spec):
                if inp.drafts[b]:
                    q[i, :len(inp.drafts[b])] = drafts[b].q[:len(inp.drafts[b])]
            where = {b: i for i, b in enumerate(spec)}
            for rows, g in gens.each(spec):
                i = [where[b] for b in rows]
                width = len(inp.drafts[rows[0]]) + 1 if gens.per_row else W  # a row's own draws: its own slots
                a[rows], tok[rows, :width] = speculative(p[i, :width], q[i, :width - 1], d[rows, :width - 1], g)
        n = torch.where(torch.tensor(inp.verify, device=device), a + 1, n)
    step = torch.cat([n[:, None], tok], dim=1).tolist()  # the one device sync of a threshold step
    new = [trim_at_stop(step[b][1:1 + min(step[b][0], w[b])], stop_ids) if w[b] else [] for b in range(R)]
    fed = [inp.real[b] + (step[b][0] - 1 if inp.verify[b] else 0) for b in range(R)]
    return new, fed, [s[0] for s in step]


def propose(model: Transformer, h: torch.Tensor, inp: StepInputs, accepted: list[int], new: list[list[int]],
            opts: Options, gens: Generators, mask_id: int, stop_ids: Stops) -> list[Drafts | None]:
    # Stage 3 of a step (§9 step 2): for each verify row, the mask group after its last accepted draft
    # proposes the next step's drafts. A chain has only the group after d_k: when fewer drafts were
    # accepted, the next step has no drafts and re-proposes. Threshold rows get None.
    R = len(new)
    temps = opts.temperatures(R)
    nxt: list[Drafts | None] = [Drafts() if inp.verify[b] else None for b in range(R)]
    go = [b for b in range(R) if inp.verify[b] and inp.group[b] and new[b][-1] not in stop_ids
          and (opts.layout == "tree" or accepted[b] - 1 == len(inp.drafts[b]))]
    if not go:
        return nxt
    T = h.shape[1]
    spine = [inp.real[b] + len(inp.drafts[b]) for b in range(R)]
    start = [spine[b] + (accepted[b] - 1 if opts.layout == "tree" else 0) * inp.group[b] for b in go]
    M = max(inp.group[b] for b in go)
    logits = at(model, h[go], [[min(s + i, T - 1) for i in range(M)] for s in start], mask_id,
                opts.vocab_size)  # (n, M, V)
    probs = torch.softmax(logits.float(), dim=-1)
    conf, tok = probs.max(dim=-1)
    hot = [i for i, b in enumerate(go) if temps[b] > 0]
    if hot:  # sampled rows draw their drafts; q is what they were drawn from
        t = torch.tensor([temps[go[i]] for i in hot], device=h.device)[:, None, None]
        probs[hot] = distribution(logits[hot].float() / t, 1.0, opts.top_p)
        for i in hot:
            m = inp.group[go[i]] if gens.per_row else M  # a row's own draws: its own masks
            tok[i, :m] = torch.multinomial(probs[i, :m], 1, generator=gens.of(go[i]))[:, 0]
        # The cut reads the slot's top probability, never the drawn token's: a cut that depended on the
        # draw would change the distribution the draft comes from, and the rule would be biased.
        conf[hot] = probs[hot].amax(dim=-1)
    keep = (conf >= opts.draft_min).long().cumprod(dim=1).sum(dim=1)  # --draft-min: stop at the first weak slot
    proposed = torch.cat([keep[:, None], tok], dim=1).tolist()
    for i, b in enumerate(go):
        k = min(proposed[i][0], inp.group[b])
        nxt[b] = Drafts(proposed[i][1:1 + k], probs[i, :k] if temps[b] > 0 else None)
    return nxt


@torch.inference_mode()
def decode_step(model: Transformer, seqs: list[list[int]], w: list[int], mask_id: int, stop_ids: Stops,
                kv: KVCache | None = None, opts: Options = Options(),
                generator: torch.Generator | list[torch.Generator | None] | None = None,
                drafts: list[Drafts | None] | None = None) -> tuple[list[list[int]], list[int], list[Drafts | None]]:
    # One forward for every row at once; decode() and serve.py's continuous batching both run it.
    # seqs[b]: row b's prompt + output so far; w[b]: the slots it may fill (0 = it sits this step out);
    # drafts[b]: None for a threshold row (§6), for a verify row (§9) the drafts its last step proposed
    # (empty at first); generator: one, or one per row. Returns what accept() and propose() return: the
    # tokens each row emits, how many fed tokens are now a verified prefix, and each verify row's next
    # drafts. Committing is the caller's choice (§7): kv.lengths are left as they were.
    R, device = len(seqs), model.model.embed_tokens.weight.device
    drafts = drafts or [None] * R
    lengths = kv.lengths if kv else [0] * R
    inp = step_inputs(seqs, w, drafts, lengths, mask_id, opts.layout, kv is not None, device)
    h = model.hidden(inp.tokens, inp.pos, inp.mask, kv)  # (R, T, C)
    W = max(len(inp.drafts[b]) + 1 if inp.verify[b] else w[b] for b in range(R))
    T = h.shape[1]
    logits = at(model, h, [[min(max(inp.real[b] - 1 + i, 0), T - 1) for i in range(W)] for b in range(R)],
                mask_id, opts.vocab_size)  # (R, W, V)
    gens = Generators(generator)
    new, fed, accepted = accept(logits, inp, w, opts, gens, drafts, stop_ids)
    return new, fed, propose(model, h, inp, accepted, new, opts, gens, mask_id, stop_ids)


@torch.inference_mode()
def decode(model: Transformer, prompts: list[list[int]], mask_id: int, stop_ids: Stops,
           tau: float = 0.9, B: int = 4, max_new_tokens: int = 256, cache: str = "cursor",
           block: int = 0, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, vocab_size: int | None = None,
           on_accept: OnAccept | None = None, verify: bool = False, layout: str = "tree",
           draft_min: float = 0.0, draft_stats: list[list[int]] | None = None) -> tuple[list[list[int]], list[int]]:
    # Returns each row's new tokens (up to and including its first stop token) and the forwards
    # that row took part in (the prompt forward counts). `block` = K, the output block size:
    # required by cache="block", optional for "none" (the reference with the same boundaries).
    # vocab_size: logits past it (spare embedding rows the tokenizer cannot decode) never compete.
    # verify: self-verification (§9) instead of the threshold: every token is the greedy one (with
    # temperature > 0, distributed as sequential sampling), tau plays no part, and `layout` (tree or
    # chain) and `draft_min` only change the speed. draft_stats, when a list, gets one
    # [drafts offered, drafts accepted] per prompt appended.
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r}: choose one of {', '.join(CACHES)}")
    if cache == "block" and block < 1:
        raise ValueError("cache='block' needs block >= 1, the output block size K")
    if verify and cache == "block":
        raise ValueError("verify needs the none, step or cursor cache: the block cache keeps its prefix "
                         "frozen within a block, so it cannot commit the drafts it accepts")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose tree or chain")
    if tau >= 1.0 and not verify:  # one token per step by rule (§6), so the masks would be dead weight: plain AR
        B = 1
    if cache == "step":  # §7's single sequence, which has no output blocks
        block = 0
    R, device = len(prompts), model.model.embed_tokens.weight.device
    opts = Options(tau, temperature, top_p, layout, draft_min, vocab_size)
    out: list[list[int]] = [[] for _ in prompts]
    forwards, done = [0] * R, [False] * R
    drafts = [Drafts() if verify else None for _ in prompts]  # verify: no drafts before the first forward
    stats = [[0, 0] for _ in prompts]  # verify: drafts offered and accepted
    # step decodes one prompt after the other with its own cache; the other modes the whole batch at once.
    for rows in [[b] for b in range(R)] if cache == "step" else [list(range(R))]:
        kv = None
        if cache != "none":
            max_len = max(len(prompts[b]) for b in rows) + max_new_tokens + max(block, B * B) + B
            kv = KVCache(model.config, len(rows), max_len, device, model.model.embed_tokens.weight.dtype)
        k = 0  # block mode: the batch's current output block (every row is in the same one)
        while not all(done[b] for b in rows):
            if cache == "block" and all(done[b] or len(out[b]) == (k + 1) * block for b in rows):
                k += 1  # every row filled block k: this forward commits it and opens block k + 1
            w = []  # slots per row this step
            for b in rows:
                if done[b]:
                    w.append(0)
                elif cache == "block" and len(out[b]) == (k + 1) * block:
                    w.append(0)  # filled block k: waits for the rest of the batch
                else:
                    w.append(window(len(out[b]), B, max_new_tokens, block))
            new, fed, nxt = decode_step(model, [prompts[b] + out[b] for b in rows], w, mask_id, stop_ids, kv, opts,
                                        generator, [drafts[b] for b in rows])
            for i, b in enumerate(rows):
                if not w[i]:
                    continue
                if verify:  # every emitted token after the step's first one is an accepted draft
                    stats[b][0] += min(len(drafts[b].tokens), w[i] - 1)
                    stats[b][1] += len(new[i]) - 1
                    drafts[b] = nxt[i]
                out[b] += new[i]
                forwards[b] += 1
                done[b] = new[i][-1] in stop_ids or len(out[b]) == max_new_tokens
                if on_accept:
                    on_accept(b, new[i])
            # What each row keeps of what it fed (§7); a row that sat out fed nothing.
            if cache == "block":  # what lies before the current block: the prefix stays frozen within a block,
                # and each step re-runs the block from its start
                kv.commit([len(prompts[b]) + k * block - kv.lengths[i] if w[i] else 0 for i, b in enumerate(rows)])
            elif cache in ("cursor", "step"):  # u, and in verify mode the accepted drafts: real tokens now;
                kv.commit(fed)  # the masks' entries are overwritten next step
            # none: no cache, the next step re-runs the whole sequence
            live = [i for i, b in enumerate(rows) if not done[b]]
            if 0 < len(live) < len(rows):  # finished rows leave the batch: later forwards skip them
                rows = [rows[i] for i in live]
                if kv is not None:
                    kv.keep(live)
    if draft_stats is not None:
        draft_stats.extend(stats)
    return out, forwards


# ---- CLI ----

@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id (owner/name) or alias (qwen2.5-0.5b, qwen2.5-7b)
    prompt: list[str] = field(default_factory=list)  # user message(s); several after one flag or repeated
    prompts: str = ""  # JSONL file, one {"messages": [...]} or {"prompt": "..."} per line
    threshold: float | None = None  # tau: accept later slots while confidence >= tau (unset: 0.9); 1.0 = plain AR
    verify: bool = False  # self-verification (docs/method.md §9): exactly the greedy tokens, several per forward
    verify_layout: Literal["tree", "chain"] = "tree"  # --verify: a mask group per acceptance length | one
    draft_min: float = 0.0  # --verify: drafts stop at the first slot whose confidence is below this
    block_size: int = 0  # B: slots per step; 0 = the B the checkpoint was trained with (its settings.json), else 4
    max_new_tokens: int = 256  # per prompt
    batch_size: int = 8  # prompts decoded together
    cache: Literal["none", "step", "cursor", "block"] = "cursor"  # none = the uncached reference; see decode()
    block_cache_size: int = 0  # K for --cache block (0 = 32); with --cache none: the same boundaries
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    raw: bool = False  # take prompts as plain text instead of rendering a chat user message
    json: bool = False  # one JSON object per prompt, then a summary line
    temperature: float = 0.0  # 0 = greedy (the paper); else sample, confidence = drawn token's prob
    top_p: float = 1.0  # nucleus sampling mass, with temperature > 0
    seed: int = 0  # seeds the sampling generator


def check_settings(s: Settings) -> None:
    # Everything that can be wrong with the flags alone, before any file is read.
    if s.threshold is not None and not 0.0 <= s.threshold <= 1.0:
        raise ValueError(f"--threshold {s.threshold} is outside [0, 1]; 1.0 decodes one token per step")
    if s.verify and s.threshold is not None:
        raise ValueError(f"--threshold {s.threshold} with --verify: verify emits exactly the greedy tokens, so no "
                         "threshold applies; drop one of the two flags")
    if s.verify and s.cache == "block":
        raise ValueError("--verify with --cache block: verify needs --cache none, step or cursor")
    if not 0.0 <= s.draft_min <= 1.0 or (s.draft_min and not s.verify):
        raise ValueError(f"--draft-min {s.draft_min}: a confidence in [0, 1], and only with --verify")
    if s.block_size < 0:
        raise ValueError(f"--block-size {s.block_size} must be at least 1 (or 0: the checkpoint's own)")
    for name in ("max_new_tokens", "batch_size"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.block_cache_size < 0 or (s.block_cache_size and s.cache not in ("block", "none")):
        raise ValueError(f"--block-cache-size {s.block_cache_size}: needs a positive size and "
                         "--cache block (or --cache none for the reference with the same blocks)")
    if not 0 <= s.temperature < float("inf") or not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"--temperature {s.temperature} must be >= 0 and --top-p {s.top_p} in (0, 1]")
    device_and_dtype(s.device, s.dtype)
    if not s.prompt and not s.prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompts FILE.jsonl")


def read_prompts(path: str) -> list[tuple[str, dict]]:
    # JSONL -> [("file:line", {"messages": [...], ...} or {"prompt": str})]; a bad line names file:line.
    if not Path(path).is_file():
        raise FileNotFoundError(f"--prompts {path}: file not found")
    rows = []
    for i, row in jsonl(path, "save the file as UTF-8 JSON Lines, one prompt object per line"):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            rows.append((f"{path}:{i}", {"prompt": row["prompt"]}))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            # A test set's rows (tasks.py) end with the reference answer: not part of the prompt.
            # Other keys ("family", "answer") stay for the callers that score the outputs.
            messages = list(row["messages"])
            while len(messages) > 1 and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
                messages.pop()
            rows.append((f"{path}:{i}", {**row, "messages": messages}))
        else:
            raise ValueError(f'{path}:{i}: expected {{"prompt": "text"}} or {{"messages": [{{"role": ..., '
                             '"content": ...}, ...]}')
    if not rows:
        raise ValueError(f"{path}: no prompts in the file")
    return rows


def encode_prompts(texts: list[str], file: str, raw: bool, tok: Tokenizer, max_new_tokens: int,
                   context: int) -> list[list[int]]:
    # --prompt texts, then the file's lines, as token ids: chat-rendered unless raw (file "messages"
    # are always chat). Checks each fits the context with its max_new_tokens.
    rows = [(f"--prompt {i}", {"prompt": t}) for i, t in enumerate(texts, 1)] + (read_prompts(file) if file else [])
    ids = []
    for where, row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        try:
            ids.append(tok.encode(row["prompt"]) if raw and "prompt" in row else
                       tok.encode_chat(messages, add_generation_prompt=True))  # checks the messages
            if not any(m["content"].strip() for m in messages):
                raise ValueError("empty prompt; give it some text")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        if len(ids[-1]) + max_new_tokens > context:
            raise ValueError(f"{where}: {len(ids[-1])} tokens + --max-new-tokens {max_new_tokens} exceed "
                             f"the model's context of {context} (max_position_embeddings in config.json); "
                             "shorten the prompt or lower --max-new-tokens")
    return ids


def streamer(tok: Tokenizer) -> OnAccept:
    # Prints one row's text as steps accept tokens, holding back an unfinished UTF-8 character.
    ids, shown = [], 0

    def on_accept(row: int, new: list[int]) -> None:
        nonlocal shown
        ids.extend(t for t in new if t not in tok.stop_ids)
        text = tok.decode(ids)
        if not text.endswith("\ufffd"):
            print(text[shown:], end="", flush=True)
            shown = len(text)
    return on_accept


def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line and exit status 2 (cli.parse). Bad files: one line naming the file and the
    # fix, exit status 1. Anything else is a bug and keeps its traceback.
    s = cli.parse(Settings, argv, "MARS decoding: several tokens per forward (docs/method.md §6, §7, §9).",
                  check=check_settings)
    try:  # every input check runs before the weights load
        path, config = check_checkpoint(s.ckpt)
        s = replace(s, block_size=trained_block_size(path, s.block_size))
        tok = Tokenizer.from_pretrained(path)
        prompts = encode_prompts(s.prompt, s.prompts, s.raw, tok, s.max_new_tokens, config.max_position_embeddings)
        device, dtype = device_and_dtype(s.device, s.dtype)
        if not s.verify:
            warn_untrained_masks(path, DEFAULT_TAU if s.threshold is None else s.threshold)
        model = load_model(path, device, dtype)
    except (ValueError, OSError) as e:  # OSError: unreadable files (FileNotFoundError, PermissionError)
        sys.exit(f"error: {e}")
    block = s.block_cache_size or (32 if s.cache == "block" else 0)
    generator = torch.Generator(device=device).manual_seed(s.seed)
    if not s.json:
        print({**asdict(s), "device": device, "dtype": str(dtype), "block_cache_size": block}, file=sys.stderr)

    outs, forwards, drafts, first, seconds = [], [], [], None, 0.0
    stream = streamer(tok) if len(prompts) == 1 and not s.json else None  # tokens print as steps accept them
    start = time.perf_counter()

    def on_accept(row: int, new: list[int]) -> None:
        nonlocal first
        first = first or time.perf_counter() - start
        if stream:
            stream(row, new)

    for i in range(0, len(prompts), s.batch_size):
        t0 = time.perf_counter()
        o, f = decode(model, prompts[i:i + s.batch_size], tok.mask_id, tok.stop_ids,
                      tau=DEFAULT_TAU if s.threshold is None else s.threshold, B=s.block_size,
                      max_new_tokens=s.max_new_tokens, cache=s.cache, block=block,
                      temperature=s.temperature, top_p=s.top_p, generator=generator,
                      vocab_size=tok.vocab_size, on_accept=on_accept, verify=s.verify,
                      layout=s.verify_layout, draft_min=s.draft_min, draft_stats=drafts)
        seconds += time.perf_counter() - t0
        outs += o
        forwards += f

    # forwards: summed over prompts, each counting the forwards its row took part in (§6: the
    # prompt's counts), so tokens per forward is per sequence, as in the paper, at any batch size.
    # --verify: drafts offered (fed for checking) and accepted (equal to the greedy token) per prompt.
    new_tokens = sum(map(len, outs))
    for i, (p, o, f) in enumerate(zip(prompts, outs, forwards)):
        text = tok.decode([t for t in o if t not in tok.stop_ids])
        if s.json:
            print(json.dumps({"prompt_ids": p, "output_ids": o, "text": text, "forwards": f,
                              "tokens_per_forward": len(o) / f, **(verify_stats(*drafts[i]) if s.verify else {})}))
        elif len(prompts) > 1:
            print(f"--- {i + 1} ---\n{text}")
    summary = {"prompts": len(prompts), "new_tokens": new_tokens, "forwards": sum(forwards),
               "tokens_per_forward": new_tokens / sum(forwards), "seconds": seconds,
               "tokens_per_second": new_tokens / seconds}
    if s.verify:
        summary |= verify_stats(sum(n for n, _ in drafts), sum(a for _, a in drafts))
    if s.json:
        print(json.dumps({"summary": summary}))
    else:
        accepted = (f" | drafts accepted {summary['drafts_accepted']}/{summary['drafts_offered']}"
                    if s.verify else "")
        print(f"\nprompt tokens {sum(map(len, prompts))} | new tokens {new_tokens} | forwards "
              f"{sum(forwards)} | {summary['tokens_per_forward']:.2f} tokens/forward{accepted} | "
              f"{summary['tokens_per_second']:.1f} tok/s | first token {first * 1000:.0f} ms", file=sys.stderr)


def verify_stats(offered: int, accepted: int) -> dict:
    return {"drafts_offered": offered, "drafts_accepted": accepted,
            "acceptance_rate": accepted / offered if offered else None}


if __name__ == "__main__":
    main()
