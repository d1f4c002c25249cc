# MARS decoding (docs/method.md §6): the rule, its oracle, and one batched decode on a KV cache.
#
# Each step appends masks after the committed text and runs one causal forward. Slot 0 is the ordinary
# next-token prediction from the last real token; slot i > 0 comes from the (i-1)-th mask. A step
# accepts slot 0 always, later slots left to right while their confidence is >= tau. mars/verify.py adds
# self-verification (§9): the same step, with last step's drafts checked against the greedy tokens; it
# loads only where a group of rows verifies. mars/layout.py lays out what each row feeds a step.
#
#   python generate.py --ckpt runs/demo/mars --prompt "What is 12 + 7?" --threshold 0.9
#   python generate.py --ckpt runs/demo/mars --prompt "What is 12 + 7?" --verify
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Literal, NamedTuple

import torch

from kvcache import KVCache
from mars.layout import LAYOUTS, Drafts, Stats, StepInputs, count, step_inputs
from model import Transformer

CACHES = ("none", "cursor", "block")
Stops = set[int] | frozenset[int]  # token ids that end a row: <|im_end|>, <|endoftext|>
OnAccept = Callable[[int, list[int]], None]  # (row, tokens accepted this step), for streaming


# ---- the rule: candidates, confidences, acceptance ----

MIN_TEMPERATURE = 1e-30  # a smaller temperature samples as this one does: the greedy token (ties aside)


def distribution(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    # logits (..., V) -> probabilities (..., V) in float32: the plain softmax when greedy (temperature
    # 0); when sampling, the softmax at the temperature cut to the top-p nucleus, what a token is drawn
    # from (and, in verify mode, what p and q of §9 are).
    x = logits.float()
    if temperature:  # the top logit at 0 first, so a tiny temperature gives the greedy choice, not inf - inf;
        # below float32's smallest number it would round to 0 (0 / 0), so it stops there
        x = (x - x.max(dim=-1, keepdim=True).values) / max(temperature, MIN_TEMPERATURE)
    probs = torch.softmax(x, dim=-1)
    if temperature and top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p, renormalise
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        drop[..., 0] = False  # the top token always stays: top_p 0 keeps it alone
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # logits (..., V) -> token (...), confidence (...): the token's probability in its distribution.
    probs = distribution(logits, temperature, top_p)
    if temperature == 0:  # greedy: the paper's setting
        conf, tok = probs.max(dim=-1)
        return tok, conf
    tok = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(probs.shape[:-1])
    return tok, probs.gather(-1, tok[..., None])[..., 0]


def accept_count(conf: torch.Tensor, tau: float) -> torch.Tensor:
    # conf (R, W) -> accepted slots per row (R,): slot 0 always, then while conf >= tau.
    # tau = 1 is one token per step by rule: a softmax probability rounds to exactly 1.0 once the top logit
    # leads by about 17, in any dtype.
    W = conf.shape[1]
    if tau >= 1.0 or W == 1:
        return torch.ones(conf.shape[0], dtype=torch.long, device=conf.device)
    return 1 + (conf[:, 1:] >= tau).long().cumprod(dim=1).sum(dim=1)


def allowed(logits: torch.Tensor, mask_id: int, vocab_size: int | None) -> torch.Tensor:
    # Candidates are real tokens: not the mask (an input symbol only), not the spare embedding rows
    # past the tokenizer's vocabulary, which it cannot decode. Sets the mask's logit to -inf in place.
    logits = logits[..., :vocab_size]
    if mask_id < logits.shape[-1]:  # a model resized to its tokenizer has no row for the mask
        logits[..., mask_id] = float("-inf")
    return logits


def trim_at_stop(tokens: list[int], stop_ids: Stops) -> list[int]:
    # Keep up to and including the first stop token: what a step accepted after EOS is dropped.
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


def window(n_out: int, B: int, max_new_tokens: int, K: int) -> int:
    # How many slots a row may fill this step: B, capped by the token budget and, with K > 0, by the
    # end of the row's current K-token output block (a step never accepts past it).
    end = (n_out // K + 1) * K if K else max_new_tokens
    return min(n_out + B, max_new_tokens, end) - n_out


# ---- how rows decode ----

@dataclass(frozen=True)
class Options:
    # How rows decode. decode() runs all its rows by one Options; serve.py groups its rows by theirs.
    tau: float = 0.9  # threshold rows accept slots 1.. while confidence >= tau; 1.0 = greedy AR
    B: int = 4  # slots per step: the block size the model was trained with
    max_new_tokens: int = 256  # per row
    cache: Literal["none", "cursor", "block"] = "cursor"  # none = the uncached reference
    K: int = 0  # the block cache's output block size; with cache none, the reference with the same output blocks
    temperature: float = 0.0  # 0 = greedy; else sample, confidence = the drawn token's probability
    top_p: float = 1.0  # sampling: the nucleus
    verify: bool = False  # self-verification (§9), tau plays no part: greedy, exactly the greedy tokens (tolerance
    # 1); sampled, speculative sampling
    layout: Literal["tree", "chain"] = "tree"  # verify: a mask group per acceptance length, or one
    draft_min: float = 0.0  # verify: drafts stop at the first slot whose confidence is below this
    draft_budget: int = 0  # verify, tree: drafts and masks a row may feed (layout.budget_layout); 0 = all
    tolerance: float = 1.0  # verify, greedy: keep d_i while p_i(d_i) >= tolerance * max p_i; 1.0 = exact
    vocab_size: int | None = None  # logits past it (spare embedding rows) never compete
    compile: bool = False  # decode steps compiled at static shapes (mars/compiled.py), the same tokens; cache=cursor

    def __post_init__(self):  # B = 0 would never move a row on: a library caller's slip, said at once
        if self.B < 1 or self.K < 0:
            raise ValueError(f"Options(B={self.B}, K={self.K}): B must be at least 1 and K at least 0")


# ---- the reference: the uncached sliding window, one sequence ----

@torch.inference_mode()
def decode_naive(model: Transformer, prompt: list[int], mask_id: int, stop_ids: Stops,
                 opts: Options = Options()) -> tuple[list[int], int]:
    # decode()'s rule with nothing else: re-runs prompt + output + B masks every step, plain causal,
    # greedy, by opts' tau, B, max_new_tokens, K (the block cache's output blocks, §7) and vocab_size.
    # Every cache mode must reproduce its tokens exactly (float32).
    assert not opts.verify and opts.temperature == 0, "the reference is the greedy threshold rule"
    check_prompts([prompt])
    out, forwards, B = [], 0, opts.B
    while len(out) < opts.max_new_tokens and not (out and out[-1] in stop_ids):
        c = len(prompt) + len(out)
        x = torch.tensor([prompt + out + [mask_id] * B], device=model.model.embed_tokens.weight.device)
        logits = model(x)[:, c - 1:c + B - 1]  # slot i from position c + i - 1; (1, B, V)
        tok, conf = sample(allowed(logits, mask_id, opts.vocab_size))
        n = min(accept_count(conf, opts.tau).item(), window(len(out), B, opts.max_new_tokens, opts.K))
        out += trim_at_stop(tok[0, :n].tolist(), stop_ids)
        forwards += 1
    return out, forwards


# ---- one step for a batch of rows ----

@dataclass
class Group:
    # Rows of one step that decode by one Options and draw from one random stream. A row with a
    # generator of its own is a group of its own: its draws then depend on its own slots alone.
    rows: list[int]
    opts: Options
    generator: torch.Generator | None = None


def logits_at(model: Transformer, h: torch.Tensor, rows: list[int], idx: list[list[int]], mask_id: int,
              vocab_size: int | None) -> torch.Tensor:
    # The allowed logits (n, W, V) at fed indices idx[i] of row rows[i]: the LM head runs there only.
    i = torch.tensor([[r] + x for r, x in zip(rows, idx)]).to(h.device, non_blocking=True)  # one copy, no sync
    return allowed(model.head(h[i[:, :1], i[:, 1:]]), mask_id, vocab_size)


def threshold_rows(model: Transformer, h: torch.Tensor, inp: StepInputs, g: Group, mask_id: int,
                   stop_ids: Stops) -> list[tuple[list[int], int, None, int]]:
    # §6 on a group of threshold rows: w_b slots, read at u_b's last token and the masks after it.
    # Per row: the tokens it emits ([] if it sat out), the fed tokens it keeps (u_b), no drafts, none accepted.
    W = max(inp.w[b] for b in g.rows)
    logits = logits_at(model, h, g.rows, [inp.slots(b, W) for b in g.rows], mask_id, g.opts.vocab_size)
    tok, conf = sample(logits, g.opts.temperature, g.opts.top_p, g.generator)
    n = accept_count(conf, g.opts.tau)
    step = torch.cat([n[:, None], tok], dim=1).tolist()  # the one device sync of a threshold step
    return [(trim_at_stop(slots[:min(accepted, inp.w[b])], stop_ids) if inp.w[b] else [], inp.uncached[b], None, 0)
            for b, (accepted, *slots) in zip(g.rows, step)]


class Step(NamedTuple):
    # What one decode_step gives each row.
    new: list[list[int]]  # the tokens it emits ([] if it sat out)
    kept: list[int]  # how many fed tokens are now real: what a cursor cache commits (u_b and accepted drafts)
    drafts: list[Drafts | None]  # its next drafts (None for a threshold row)
    offered: list[int]  # the drafts it fed for checking (0 for a threshold row)
    accepted: list[int]  # the drafts among the tokens it emits (0 for a threshold row): a stop may be one
    fed: list[int]  # the positions it fed: u_b, drafts and masks (StepInputs.fed)


@torch.inference_mode()
def decode_step(model: Transformer, seqs: list[list[int]], w: list[int], drafts: list[Drafts | None],
                kv: KVCache | None, groups: list[Group], mask_id: int, stop_ids: Stops) -> Step:
    # One forward for every row at once; decode() and serve.py's continuous batching both run it.
    # seqs[b]: row b's prompt and output so far; w[b]: the slots it may fill (0: it sits out); drafts[b]:
    # None for a threshold row, for a verify row the drafts its last step proposed (empty at first).
    # A row in no group sits out. Committing is the caller's choice: kv.lengths are left as they were.
    R, tree, budget = len(seqs), [False] * len(seqs), [0] * len(seqs)
    for g in groups:
        assert all((drafts[b] is not None) == g.opts.verify for b in g.rows if w[b])
        for b in g.rows:
            tree[b], budget[b] = g.opts.layout == "tree", g.opts.draft_budget
    static = kv is not None and any(g.opts.compile for g in groups)  # laid out on the host, sent in one copy
    device = "cpu" if static else model.model.embed_tokens.weight.device
    inp = step_inputs(seqs, w, drafts, kv, mask_id, tree, device, budget)
    if static:  # the compiled step loads where a group asks for it
        from mars import compiled
        h = compiled.hidden(model, inp, kv, max(compiled.width(g.opts) for g in groups))
    else:
        h = model.hidden(inp.tokens, inp.pos, inp.mask, kv)  # (R, T, C)
    new, kept, proposed, accepted = [[] for _ in seqs], [0] * R, [None] * R, [0] * R
    for g in groups:
        rule = threshold_rows
        if g.opts.verify:  # self-verification (§9) loads where a group verifies
            from mars import verify
            rule = verify.verify_rows
        for b, row in zip(g.rows, rule(model, h, inp, g, mask_id, stop_ids)):
            new[b], kept[b], proposed[b], accepted[b] = row
    offered = [len(d.tokens) if d else 0 for d in inp.drafts]
    return Step(new=new, kept=kept, drafts=proposed, offered=offered, accepted=accepted, fed=inp.fed)


# ---- decoding a batch of prompts ----

def new_cache(model: Transformer, prompts: list[list[int]], opts: Options, B: int) -> KVCache:
    if opts.compile:  # a cache of one shape while rows finish
        from mars import compiled
        return compiled.new_cache(model, prompts, opts)
    # scratch past the committed tokens: a full verify tree feeds B^2 positions (1 + (B-1) + B(B-1)), a
    # block-cache step re-feeds up to K, and B more as slack
    max_len = max(map(len, prompts)) + opts.max_new_tokens + max(opts.K, B * B) + B
    return KVCache(model.config, len(prompts), max_len, model.model.embed_tokens.weight.device,
                   model.model.embed_tokens.weight.dtype)


def groups(rows: list[int], opts: Options, generator: torch.Generator | list[torch.Generator] | None) -> list[Group]:
    # A step's groups (row i of the step decodes prompt rows[i]): every row in one group on the shared
    # generator, or, given one generator per prompt, each row in a group of its own with its prompt's.
    if isinstance(generator, list):
        return [Group([i], opts, generator[b]) for i, b in enumerate(rows)]
    return [Group(list(range(len(rows))), opts, generator)]


def prompt_generator(seed: int, i: int, device: str | torch.device) -> torch.Generator:
    # Prompt i of a run samples from a generator of its own, seeded by the run's seed and i: its text then
    # depends on neither the batch size nor the prompts beside it (in exact arithmetic; a bf16 batch's padding
    # can flip a near-tie). generate.py and tools/lm_eval_mars.py seed them alike.
    mixed = hashlib.sha256(f"{seed} {i}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(mixed[:8], "little") >> 1)


def finished(out: list[int], stop_ids: Stops, max_new_tokens: int) -> bool:
    return (bool(out) and out[-1] in stop_ids) or len(out) >= max_new_tokens


def check_prompts(prompts: list[list[int]]) -> None:
    # Slot 0 is read at a prompt's last token: an empty prompt has none.
    if empty := [i for i, p in enumerate(prompts) if not p]:
        raise ValueError(f"prompt {empty[0]} of {len(prompts)} is empty: a prompt needs at least one token "
                         "(a chat prompt's template gives it some)")


@torch.inference_mode()
def decode(model: Transformer, prompts: list[list[int]], mask_id: int, stop_ids: Stops, opts: Options = Options(),
           generator: torch.Generator | list[torch.Generator] | None = None, on_accept: OnAccept | None = None,
           stats: Stats | None = None) -> tuple[list[list[int]], list[int]]:
    # decode_naive's rule for a batch: one forward per step for every row still decoding, on the cursor
    # cache (each row commits its own accepted tokens) or none. Returns each row's new tokens (up to and
    # including its first stop token) and the forwards it took part in (the prompt's counts). generator: the
    # sampling's, shared by the rows, or one per prompt, so that a row's draws, and its text, do not depend on
    # the other rows of the batch (a rule call per row: slower).
    assert opts.cache in CACHES, f"cache={opts.cache!r}: choose one of {', '.join(CACHES)}"
    assert opts.layout in LAYOUTS, f"layout={opts.layout!r}: choose tree or chain"
    assert not opts.compile or opts.cache == "cursor", f"compile with cache={opts.cache!r}: compile needs cache=cursor"
    check_prompts(prompts)
    if opts.max_new_tokens <= 0:  # nothing to decode: no forward
        if stats is not None:
            for name in ("offered", "accepted", "positions", "steps"):
                getattr(stats, name).extend([0] * len(prompts))
        return [[] for _ in prompts], [0] * len(prompts)
    if opts.cache == "block":
        return decode_blocks(model, prompts, mask_id, stop_ids, opts, generator, on_accept, stats)
    B = opts.B if opts.verify or opts.tau < 1.0 else 1  # tau 1: one token per step by rule, no masks: plain AR
    out, forwards = [[] for _ in prompts], [0] * len(prompts)
    drafts = [Drafts() if opts.verify else None for _ in prompts]  # no drafts before the first forward
    own = Stats(offered=[0] * len(prompts), accepted=[0] * len(prompts), positions=[0] * len(prompts),
                steps=[0] * len(prompts))
    kv = new_cache(model, prompts, opts, B) if opts.cache == "cursor" else None
    rows = list(range(len(prompts)))  # the rows still decoding
    while rows:
        w = [window(len(out[b]), B, opts.max_new_tokens, opts.K) for b in rows]
        new, kept, proposed, offered, accepted, fed = decode_step(model, [prompts[b] + out[b] for b in rows], w,
                                                                  [drafts[b] for b in rows], kv,
                                                                  groups(rows, opts, generator), mask_id, stop_ids)
        for i, b in enumerate(rows):
            if forwards[b]:  # not the prompt's forward
                own.positions[b] += fed[i]
                own.steps[b] += 1
            if opts.verify:
                count(own, b, offered[i], accepted[i])
                drafts[b] = proposed[i]
            out[b] += new[i]
            forwards[b] += 1
            if on_accept:
                on_accept(b, new[i])
        if kv is not None:  # u and the accepted drafts are real tokens now; the masks' entries are scratch
            kv.commit(kept)
        live = [i for i, b in enumerate(rows) if not finished(out[b], stop_ids, opts.max_new_tokens)]
        if 0 < len(live) < len(rows) and kv is not None:
            kv.keep_rows(live)  # finished rows leave the batch: later forwards skip them
        rows = [rows[i] for i in live]
    if stats is not None:
        for name in ("offered", "accepted", "positions", "steps"):
            getattr(stats, name).extend(getattr(own, name))
    return out, forwards


def decode_blocks(model: Transformer, prompts: list[list[int]], mask_id: int, stop_ids: Stops, opts: Options,
                  generator: torch.Generator | list[torch.Generator] | None = None,
                  on_accept: OnAccept | None = None, stats: Stats | None = None) -> tuple[list[list[int]], list[int]]:
    # The paper's block cache (§7): the batch decodes K-token output blocks in lockstep. The cache holds
    # each row's prompt and finished output blocks, frozen; every step re-runs the current output block
    # from its start, and a row that filled it sits out until every row has.
    assert opts.K >= 1 and not opts.verify, "the block cache needs K >= 1 and cannot commit verified drafts"
    K = opts.K
    B = opts.B if opts.tau < 1.0 else 1
    out, forwards, fed = [[] for _ in prompts], [0] * len(prompts), [0] * len(prompts)
    kv = new_cache(model, prompts, opts, B)
    rows, k = list(range(len(prompts))), 0  # the rows still decoding; the batch's current output block
    while rows:
        if all(len(out[b]) == (k + 1) * K for b in rows):
            k += 1  # every row filled output block k: this forward commits it and opens block k + 1
        w = [0 if len(out[b]) == (k + 1) * K else window(len(out[b]), B, opts.max_new_tokens, K) for b in rows]
        step = decode_step(model, [prompts[b] + out[b] for b in rows], w, [None] * len(rows), kv,
                           groups(rows, opts, generator), mask_id, stop_ids)
        for i, b in enumerate(rows):
            if w[i]:
                fed[b] += step.fed[i] if forwards[b] else 0  # not the prompt's forward
                out[b] += step.new[i]
                forwards[b] += 1
                if on_accept:
                    on_accept(b, step.new[i])
        # A row keeps what lies before the current output block; one that sat out fed nothing.
        kv.commit([len(prompts[b]) + k * K - kv.lengths[i] if w[i] else 0 for i, b in enumerate(rows)])
        live = [i for i, b in enumerate(rows) if not finished(out[b], stop_ids, opts.max_new_tokens)]
        if 0 < len(live) < len(rows):
            kv.keep_rows(live)
        rows = [rows[i] for i in live]
    if stats is not None:
        stats.offered += [0] * len(prompts)
        stats.accepted += [0] * len(prompts)
        stats.positions += fed
        stats.steps += [f - 1 for f in forwards]
    return out, forwards


# ---- CLI ----

def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line and exit status 2 (cli.parse); bad files: one line naming the file and the fix,
    # exit status 1 (prompts.load). Ctrl-C: one line, status 130; a reader that stops reading (| head): quiet.
    # Anything else is a bug and keeps its traceback.
    try:
        run(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone by then is caught below
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # stdout's reader is gone: nothing more to say to it, and no traceback
        try:  # so that the exit's own flush does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout is no file (an embedding caller's)
            pass
        raise SystemExit(1) from None


def run(argv: list[str] | None) -> None:
    # The product around the rule (flags, checkpoint files, the tokenizer, the measured draft budget) loads here.
    from mars import cli
    from mars.prompts import DEFAULT_TAU, Settings, check_settings, load, report, sized_budget, streamer

    s = cli.parse(Settings, argv, "MARS decoding: several tokens per forward (docs/method.md).", check=check_settings)
    if hasattr(sys.stdout, "reconfigure"):  # a reply's character that stdout's encoding lacks prints as "?"
        sys.stdout.reconfigure(errors="replace")
    s, tok, prompts, model = load(s)  # every input check runs before the weights load
    s = sized_budget(s, model, min(s.batch_size, len(prompts)))  # --draft-budget auto: the number measured here
    K = s.block_cache_size or (32 if s.cache == "block" else 0)  # the block cache's output block size
    opts = Options(tau=DEFAULT_TAU if s.threshold is None else s.threshold, B=s.block_size,
                   max_new_tokens=s.max_new_tokens, cache=s.cache, K=K,
                   temperature=s.temperature, top_p=s.top_p, verify=s.verify, layout=s.verify_layout,
                   draft_min=s.draft_min, draft_budget=0 if s.draft_budget == "auto" else int(s.draft_budget),
                   tolerance=s.tolerance, vocab_size=tok.vocab_size, compile=s.compile)
    if s.verbose:
        print({**asdict(s), "dtype": str(model.model.embed_tokens.weight.dtype), "block_cache_size": opts.K},
              file=sys.stderr)
    generators = [prompt_generator(s.seed, i, s.device) for i in range(len(prompts))]

    outs, forwards, stats, first, seconds = [], [], Stats(), None, 0.0
    stream = streamer(tok) if len(prompts) == 1 and not s.json else None  # tokens print as steps accept them
    start = time.perf_counter()

    def on_accept(row: int, new: list[int]) -> None:
        nonlocal first
        first = first or time.perf_counter() - start
        if stream:
            stream(row, new)

    for i in range(0, len(prompts), s.batch_size):
        t0 = time.perf_counter()
        o, f = decode(model, prompts[i:i + s.batch_size], tok.mask_id, tok.stop_ids, opts,
                      generators[i:i + s.batch_size] if s.temperature else None, on_accept, stats)
        seconds += time.perf_counter() - t0
        outs += o
        forwards += f
    if stream:
        stream(0, [], final=True)  # what an unfinished character held back, when the reply ends on one
    report(s, tok, prompts, outs, forwards, stats, seconds, first)


if __name__ == "__main__":
    main()
