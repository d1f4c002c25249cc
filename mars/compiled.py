# A compiled decode step, opt-in (generate.Options.compile; --compile on generate.py and serve.py): the
# eager step of generate.py stays the reference. On a GPU a decode step of a small model is bound by
# kernel launches, about a thousand a forward; torch.compile fuses them and, on CUDA, replays the whole
# forward as one CUDA graph (mode="reduce-overhead"). A graph fixes its shapes and the addresses it reads
# and writes, so a compiled step, like gpt-fast's decode_one_token:
# - attends over the whole preallocated cache (S = its max_len) under a mask, not over the columns in use;
# - feeds a fixed width W per configuration (width()): a row's own fed tokens first, then pads that see
#   themselves and that no real token sees;
# - runs over every buffer row of the cache: a row that left the batch (StaticCache, decode's) or that is in
#   another forward (a server's other rows) is fed pads only, which write the last W columns of its buffer row;
# - writes the cache in place at columns the device computes from the lengths, which arrive with the
#   tokens, positions and layout in one host-to-device copy (pack), so the step has no host sync of its own.
# A prompt's prefill is wider than W and its length varies: it runs eagerly. The rule (acceptance, verify)
# runs eagerly on the hidden states, the same code as without compile, so the tokens are the eager path's.
from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

from kvcache import KVCache
from mars.adapter import MaskAdapter
from mars.layout import StepInputs
from model import Config, Transformer

# model -> its compiled step, made at its first compiled step. A test may put `step` itself here: the same
# static shapes, run eagerly.
COMPILED: weakref.WeakKeyDictionary[Transformer, Callable] = weakref.WeakKeyDictionary()


def pow2(n: int) -> int:  # the smallest power of two >= n >= 1
    return 1 << (n - 1).bit_length()


def width(opts) -> int:
    # W for rows that decode by opts (a generate.Options): the widest step they feed after the prompt's. A
    # threshold row feeds the tokens it accepted last step (at most B) and B - 1 masks, or one token at tau 1
    # (B = 1, plain AR); a verify row its last token, up to B - 1 drafts and their masks: B - 1 after the
    # last draft (chain), or after each of them (tree), B^2 in all, fewer within a draft budget. A power of
    # two, so that a server's budget, which moves from step to step, gives few widths.
    B = opts.B
    if not opts.verify:
        w = 1 if opts.tau >= 1.0 else 2 * B - 1
    elif opts.layout == "chain":
        w = 2 * B - 1
    else:
        w = min(B * B, max(2 * B - 1, 1 + opts.draft_budget)) if opts.draft_budget else B * B
    return pow2(w)


def fullest_budget(B: int, budget: int) -> int:
    # The largest draft budget whose compiled step runs at `budget`'s width: a compiled step feeds its width
    # whatever the budget, so the drafts up to it cost nothing more (a full tree's is B^2 - 1).
    return min(pow2(min(B * B, max(2 * B - 1, 1 + budget))) - 1, B * B - 1)


class StaticCache(KVCache):
    # decode()'s cursor cache under compile. A row that finishes leaves the batch (keep_rows) but keeps its
    # buffer row (its slot): every compiled step of a decode has one shape. The lengths stay on the host;
    # a step sends them with its tokens. reuse: an earlier StaticCache of this shape, whose buffers this one
    # takes (new_cache), zeroed in place: a masked key is out of a query's weights but not out of SDPA's
    # arithmetic, so a NaN an earlier decode left there would reach every row.
    def __init__(self, config: Config, batch_size: int, max_len: int, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32, reuse: StaticCache | None = None):
        if reuse is None:
            super().__init__(config, batch_size, max_len, device, dtype)
        else:
            assert reuse.k.shape[1] == batch_size and reuse.max_len == max_len, "reuse a cache of this shape"
            self.k, self.v, self.max_len = reuse.k.zero_(), reuse.v.zero_(), max_len
            self.set_lengths([0] * batch_size)
        self.slots = list(range(batch_size))  # the buffer row of each row still in the batch

    def set_lengths(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        raise RuntimeError("a StaticCache is written by mars/compiled.py's step, not by an eager forward")

    def keep_rows(self, rows: list[int]) -> None:
        self.slots = [self.slots[r] for r in rows]
        self.set_lengths([self.lengths[r] for r in rows])


# model -> ((rows, S, dtype, device), its last StaticCache), whose buffers the next one of that shape takes: a
# CUDA graph replays at the addresses it was recorded at, and new buffers would record it again every decode().
# One cache a model, the last decode's: a batch of another shape frees it. So a model's compiled decodes run
# one at a time (two at once would share the buffers), as its graphs do.
LAST: weakref.WeakKeyDictionary[Transformer, tuple[tuple, StaticCache]] = weakref.WeakKeyDictionary()


def new_cache(model: Transformer, prompts: list[list[int]], opts) -> StaticCache:
    # Room for the longest prompt, its new tokens and a step of width W after them, rounded up to a power of
    # two so that the batches of one run share a shape, and their buffers (LAST).
    S = pow2(max(map(len, prompts)) + opts.max_new_tokens + width(opts))
    w = model.model.embed_tokens.weight
    shape, (last_shape, last) = (len(prompts), S, w.dtype, w.device), LAST.pop(model, (None, None))
    kv = StaticCache(model.config, len(prompts), S, w.device, w.dtype, reuse=last if last_shape == shape else None)
    LAST[model] = shape, kv
    return kv


def whole(kv: KVCache) -> tuple[KVCache, list[int]]:
    # The cache that owns kv's buffers, and the buffer row of each of kv's rows in it. A server's forward
    # runs on a view of a run of its rows (mars/serve.py, ServerCache.rows), which lies in its owner.
    if isinstance(kv, StaticCache):
        return kv, kv.slots
    owner = getattr(kv, "owner", None)
    if owner is not None:
        return owner, list(range(kv.first, kv.first + kv.batch_size))
    return kv, list(range(kv.batch_size))


# ---- one step ----

class Writes:
    # The cache as Attention sees it in a static step: each layer writes its W new keys and values to the
    # columns cols (N, W) of its buffer rows and attends over the whole buffer. Each layer's buffer is an
    # input of its own, written by index_put_, which inductor runs in place; a write through a view of the
    # whole cache (k[layer]) would copy the cache every step.
    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], cols: torch.Tensor):
        self.k, self.v, self.cols = k, v, cols
        self.rows = torch.arange(cols.shape[0], device=cols.device)[:, None]  # (N, 1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v (N, Hkv, W, D); advanced indices around a slice put their dims first: (N, W, Hkv, D)
        self.k[layer][self.rows, :, self.cols] = k.transpose(1, 2)
        self.v[layer][self.rows, :, self.cols] = v.transpose(1, 2)
        return self.k[layer], self.v[layer]  # (N, Hkv, S, D)


def step(model: Transformer, x: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    # One forward over every buffer row. x (N, 4W + 2) from pack; k, v per layer (N, Hkv, S, D), the whole
    # cache, written in place. Returns the hidden states (N, W, C).
    N, W, S = x.shape[0], (x.shape[1] - 2) // 4, k[0].shape[2]
    tokens, pos, end, group = x[:, :4 * W].view(N, 4, W).unbind(1)
    start = x[:, 4 * W]  # (N,) the column of each buffer row's first fed token
    j = torch.arange(W, device=x.device)
    # layout.tree_mask with the lengths on the device. Key column c holds fed token c - start (committed
    # below 0): a spine key (u, drafts, pads) is seen up to each query's anchor (end), a mask only by the
    # later masks of its own group.
    col = (torch.arange(S, device=x.device) - start[:, None])[:, None]  # (N, 1, S)
    key_group = group.gather(1, col[:, 0].clamp(0, W - 1))[:, None]  # (N, 1, S), -1 on the spine
    fed = torch.where(key_group < 0, col <= end[..., None], (key_group == group[..., None]) & (col <= j[:, None]))
    mask = ((col < 0) | ((col < W) & fed))[:, None]  # (N, 1, W, S), True = may attend
    return model.hidden(tokens, pos, mask, Writes(k, v, start[:, None] + j))


def pack(inp: StepInputs, lengths: list[int], slots: list[int], N: int, W: int, S: int) -> torch.Tensor:
    # A step's inputs for every buffer row, on the host: (N, 4W + 2) int64, the fed tokens, their positions,
    # the last spine index each may see (end) and its mask group (-1: u, drafts and pads), as
    # layout.tree_mask reads them; then the column of its first fed token; then, in rows 0..R-1, the slot of
    # each of the step's rows. A buffer row that feeds nothing gets pads at the last W columns of its
    # buffer row, past anything a row holds.
    T = inp.tokens.shape[1]
    j = list(range(W))
    rows = [pads(W, S) for _ in range(N)]
    tokens, pos = inp.tokens.tolist(), inp.pos.tolist()  # on the CPU: no device sync
    for r, n in enumerate(slots):
        if inp.fed[r]:
            end, group = list(j), [-1] * W
            for a, (first, m) in inp.groups[r].items():  # the mask group after d_a sees the spine up to d_a
                end[first:first + m] = [inp.uncached[r] - 1 + a] * m
                group[first:first + m] = [a] * m
            rows[n] = (tokens[r] + [0] * (W - T) + pos[r] + [lengths[r] + i for i in j[T:]] + end + group
                       + [lengths[r], 0])
    for r, n in enumerate(slots):
        rows[r][-1] = n
    return torch.tensor(rows)


def pads(W: int, S: int) -> list[int]:
    # pack's row for a buffer row that feeds nothing: W pads at its last W columns, each seeing itself.
    j = list(range(W))
    return [0] * W + [S - W + i for i in j] + j + [-1] * W + [S - W, 0]


def check_compiler(device: str | torch.device) -> None:
    # On the CPU, inductor builds each compiled step with a C++ compiler: without one the first step would fail
    # deep in torch, after the model has loaded. Said before it loads, in one line.
    if torch.device(device).type != "cpu":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch's layout: the compile itself will say
        return
    try:
        get_cpp_compiler()
    except Exception as e:  # InvalidCxxCompiler
        one = "; torch takes CXX as one command, not a command with arguments" * (" " in os.environ.get("CXX", ""))
        raise ValueError(f"--compile on the CPU needs a C++ compiler to build the compiled step ({e}{one}); install "
                         "g++ (or set CXX), or drop --compile") from None


def compiled(model: Transformer) -> Callable:
    # The model's compiled step, made once. dynamic=False: one graph per shape (buffer rows, W, S), a
    # handful per run; on CUDA each is also a CUDA graph.
    if model not in COMPILED:
        cuda = model.model.embed_tokens.weight.is_cuda
        COMPILED[model] = torch.compile(step, dynamic=False, mode="reduce-overhead" if cuda else None)
    return COMPILED[model]


def hidden(model: Transformer, inp: StepInputs, kv: KVCache, W: int) -> torch.Tensor:
    # generate.decode_step's forward under compile: inp laid out on the host (step_inputs on the CPU), W
    # the widest step of the step's options (width). Returns the hidden states (R, T, C) of the step's
    # rows, as model.hidden gives them.
    R, T = inp.tokens.shape
    device = model.model.embed_tokens.weight.device
    if T > W and not isinstance(kv, StaticCache):  # a prompt's prefill: its length varies, it runs eagerly
        return model.hidden(*(t.to(device, non_blocking=True) for t in (inp.tokens, inp.pos, inp.mask)), kv)
    # decode()'s prefill runs the same static step, eagerly, at its own width
    run = compiled(model) if T <= W else step
    base, slots = whole(kv)
    W = max(W, T)
    # Every fed row writes W columns from its length. A buffer row fed nothing writes pads at its last W
    # columns, where it must hold nothing: in a server's cache it is another request's row, so the fed rows
    # stay below them too (its cache has room: mars/serve.py). In decode()'s StaticCache it is a row that
    # finished, never read again, or there is none (the prefill feeds every row): no columns to keep clear.
    pads = W if not isinstance(kv, StaticCache) and (len(slots) < base.k.shape[1] or not all(inp.fed)) else 0
    if (longest := max(kv.lengths)) + W + (T if pads else 0) > base.max_len:
        raise RuntimeError(f"KV cache overflow: a row of {longest} writes {W} columns"
                           + (f", {T} of them kept below {pads} pad columns" if pads else "")
                           + f", in max_len {base.max_len}")
    x = pack(inp, kv.lengths, slots, base.k.shape[1], W, base.max_len).to(device, non_blocking=True)
    h = on_cache(run, model, x, base)  # (N, W, C)
    if slots == list(range(slots[0], slots[0] + R)):  # a run of buffer rows: a view
        return h[slots[0]:slots[0] + R, :T]
    return h.index_select(0, x[:R, -1])[:, :T]


def on_cache(run: Callable, model: Transformer, x: torch.Tensor, kv: KVCache) -> torch.Tensor:
    # run (the compiled step, or step) on x over every buffer row of kv, the cache that owns its buffers.
    k, v = list(kv.k.unbind(0)), list(kv.v.unbind(0))  # per layer (N, Hkv, S, D), views
    if isinstance(adapter := getattr(model, "adapter", None), MaskAdapter):
        adapter.ready()  # its float32 copies, which the step reads, made outside it
    if x.is_cuda:  # the graph reads and writes the cache in place, at these addresses
        for buffer in k + v:
            torch._dynamo.mark_static_address(buffer, guard=False)
        torch.compiler.cudagraph_mark_step_begin()
    return run(model, x, k, v)


def warm(model: Transformer, kv: KVCache, widths: list[int]) -> None:
    # Compiles the step at each width before any request: a server's first requests would otherwise wait
    # for it. Steps of pads only, over every buffer row of kv (empty), write its last W columns, which
    # hold nothing.
    assert not any(kv.lengths), "warm() writes pads into the cache: call it before the first request"
    device = kv.k.device
    with torch.inference_mode():  # as decoding runs: a graph compiled with autograd on would not be reused
        for W in sorted(set(widths)):
            x = torch.tensor([pads(W, kv.max_len)] * kv.k.shape[1]).to(device)
            for _ in range(3 if device.type == "cuda" else 1):  # CUDA graphs: a warm-up run, a recording, a replay
                on_cache(compiled(model), model, x, kv)
