# The draft budget sized to the machine (docs/method.md §9). t_R(n) is the measured time of one cached
# forward in which R rows feed n positions each. A verify row that feeds N drafts and masks emits, in
# the long run, tok(N) tokens per step (the budget rule run to its steady state), so R such rows emit
# R tok(N) / t_R(1 + N) tokens per second: the best N shrinks as the batch grows. serve.py sets each
# step's budget by the rows it runs (Policy); tools/forward_cost.py writes and reads the curves.
from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

import torch

from kvcache import KVCache
from mars import layout
from mars.adapter import MaskAdapter
from model import Transformer

# eval.py's budget for its verify modes, fixed so that every evaluation is alike: the positions per row
# that maximise expected tokens per second for the real 0.5B at batch 1 in bf16 on a 2-core AVX-512 BF16
# CPU (results/forward_cost.json). generate.py and serve.py measure their own machine (--draft-budget auto).
DEFAULT_BUDGET = 12
PRIOR = [0.7, 0.55, 0.45]  # a trained adapter's acceptance of drafts 1-3 (docs/method.md §9), before a run's own
REPS = 5  # timed rounds of every width for --draft-budget auto: each median drops a round or two slowed by load


def widths(G: int) -> list[int]:
    # The widths a verify row can feed, from one position to the full tree's 1 + G (G + 2), that a curve
    # measures; the rest are interpolated.
    full = 1 + G * (G + 2)
    return sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n < full} | {full})


def measured_budget(model: Transformer, R: int, G: int) -> tuple[int, list[int], list[float]]:
    # --draft-budget auto for a run of R rows: t_R(n) measured here (a few seconds on the real 0.5B), then
    # the budget with the most expected tokens per second under the prior acceptance. -> (the budget, the
    # widths, their seconds).
    ns = widths(G)
    seconds = rising(measure(model, R, ns, context=64, reps=REPS))
    return best_budget(PRIOR, G, lambda n: interpolate(ns, seconds, n))[0], ns, seconds


def rising(seconds: list[float]) -> list[float]:
    # A wider forward never costs less than a narrower one: each width's time is at most that of every
    # wider one, so load that slowed a narrow width in most of its rounds does not make the wide ones cheap.
    return [min(seconds[i:]) for i in range(len(seconds))]


@torch.inference_mode()
def measure(model: Transformer, R: int, widths: list[int], context: int = 256, reps: int = 3,
            head_positions: int = 16, timer: Callable[[], float] = time.perf_counter) -> list[float]:
    # Seconds of one forward per width n in widths: R rows, n new tokens each at positions
    # context..context+n-1, causal over the cache, the LM head at min(n, head_positions) positions per
    # row (as a decode step reads it); nothing is committed, so every width starts alike. The median of
    # reps rounds after a warm-up round; timer: the clock (a fake one in tests). On a model with a gated
    # adapter, whose hooks work at the masks, the n positions are a token and n - 1 masks, as a verify
    # step feeds mostly masks.
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    kv = KVCache(model.config, R, context + max(widths), device, dtype)
    V = min(model.config.vocab_size, 1000)
    gated = isinstance(getattr(model, "adapter", None), MaskAdapter)
    mask_id = model.adapter.mask_id if gated else -1  # the random tokens are real ones: never the mask

    def real(shape: tuple[int, int], seed: int) -> torch.Tensor:
        x = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed)).to(device)
        return torch.where(x == mask_id, 0, x)

    prompt = real((R, context), 0)
    model.hidden(prompt, None, None, kv)
    kv.commit([context] * R)
    forwards = []
    for n in widths:
        tokens = real((R, n), n)
        pos = context + torch.arange(n, device=device).expand(R, n)
        if gated:
            tokens[:, 1:] = mask_id
        mask = (torch.arange(context + n, device=device) <= pos[..., None])[:, None]  # (R, 1, n, S)

        def forward(tokens=tokens, pos=pos, mask=mask) -> None:
            model.head(model.hidden(tokens, pos, mask, kv)[:, :head_positions])

        forwards.append(forward)
    # Every width once a round: a burst of load slows one round of several widths, which their medians
    # drop, rather than every timing of one width. The first round is a warm-up.
    rounds = [[seconds_of(forward, device, timer) for forward in forwards] for _ in range(reps + 1)]
    return [statistics.median(times) for times in zip(*rounds[1:])]


def seconds_of(fn: Callable[[], object], device: torch.device, timer: Callable[[], float] = time.perf_counter) -> float:
    # The wall-clock seconds of one call of fn, the device synchronised around it.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = timer()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return timer() - t0


def median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    # The median wall-clock seconds of reps calls of fn after one warm-up.
    return statistics.median([seconds_of(fn, device) for _ in range(reps + 1)][1:])


def interpolate(ns: list[int], seconds: list[float], n: float) -> float:
    # t(n) between measured widths, linear; past the widest, in proportion to n.
    if n >= ns[-1]:
        return seconds[-1] * n / ns[-1]
    i = next(j for j, m in enumerate(ns) if m >= n)
    if ns[i] == n or i == 0:
        return seconds[i]
    w = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
    return seconds[i - 1] * (1 - w) + seconds[i] * w


def steady_state(acceptance: list[float], G: int, budget: int, t) -> tuple[float, float, float]:
    # The budget rule's long-run (tokens per forward, positions fed per row, tokens per second) for a row
    # whose draft i is accepted with chance acceptance[i - 1] once d_1..d_{i-1} are; t(n): the seconds of a
    # forward feeding n positions.
    chance = chances(acceptance, G)
    return long_run(chance, [layout.budget_layout(chance[:k], G, budget) for k in range(G + 1)], t)


def chances(acceptance: list[float], G: int) -> list[float]:  # each of the G drafts' (the last value repeats)
    return (acceptance + [acceptance[-1]] * G)[:G]


def long_run(chance: list[float], layouts: list[tuple[int, list[int]]], t) -> tuple[float, float, float]:
    # steady_state of the rule that lays a step out as layouts[k] when it starts with k drafts (0..G): the
    # group fed after the realised acceptance sets the next state, or 0 when that group was not fed.
    S = len(layouts)
    move, tokens, cost, fed = [[0.0] * S for _ in range(S)], [], [], []  # move[k][j]: state k -> j
    for k, (drafts, sizes) in enumerate(layouts):
        run, exactly = layout.acceptance(chance[:drafts])
        for a, size in enumerate(sizes):
            move[k][size] += exactly[a]
        tokens.append(sum(run))  # the step's own token, then each draft while all before it hold
        fed.append(1 + drafts + sum(sizes))
        cost.append(t(fed[-1]))
    # The stationary distribution: pi (move - I) = 0 with sum(pi) = 1 (a chain may be periodic, 0 -> 2 -> 0,
    # so iterating pi @ move need not converge).
    move = torch.tensor(move, dtype=torch.float64)
    A = torch.cat([(move - torch.eye(S, dtype=torch.float64)).T, torch.ones(1, S, dtype=torch.float64)])
    b = torch.cat([torch.zeros(S, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    pi = torch.linalg.lstsq(A, b[:, None]).solution[:, 0]
    tok, pos, sec = (sum(float(p) * x for p, x in zip(pi, xs)) for xs in (tokens, fed, cost))
    return tok, pos, tok / sec


def every_budget(conf: list[float], G: int, most: int) -> list[tuple[int, list[int]]]:
    # layout.budget_layout(conf, G, N) for N = 1 .. most from one ranking: budget N keeps its first N positions,
    # so each layout is the one before it and one more position.
    ranked, drafts, deepest, out = layout.ranked_positions(conf, G), 0, [0] * (len(conf) + 1), []
    for N in range(most):
        if N < len(ranked):
            _, kind, a, m = ranked[N]
            if kind == 0:
                drafts = max(drafts, a)
            else:
                deepest[a] = max(deepest[a], m)
        out.append((drafts, deepest[:drafts + 1]))
    return out


AR_STEP = -1  # a budget of no drafts at all: the step runs its greedy rows as plain AR, one position each


def best_budget(acceptance: list[float], G: int, t, ar: bool = False) -> tuple[int, tuple[float, float, float]]:
    # The budget (1 .. the full tree's size) with the most expected tokens per second, and its steady state;
    # with ar, AR_STEP when plain AR (one token per one-position forward) is faster than every budget.
    # No masks (B = 1): no drafts, one token per one-position forward.
    if G == 0:
        return 0, (1.0, 1.0, 1.0 / t(1))
    chance, most = chances(acceptance, G), G * (G + 2)
    states = [every_budget(chance[:k], G, most) for k in range(G + 1)]  # states[k][N - 1]: budget N's layout
    table = {N: long_run(chance, [state[N - 1] for state in states], t) for N in range(1, most + 1)}
    if ar:
        table[AR_STEP] = (1.0, 1.0, 1.0 / t(1))
    best = max(table, key=lambda N: table[N][2])
    return best, table[best]


def ladder(G: int) -> list[int]:
    # The budgets the server's climb moves between, in order: plain AR (AR_STEP), then positions per row
    # from 1 to the full tree's G (G + 2), each rung about 1.4x the one below.
    full = G * (G + 2)
    return [AR_STEP] + sorted({n for n in (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64) if n < full} | {full})


class Climb:
    # The step's budget chosen by measured speed (docs/serving.md). The cost model starts each row
    # count R at a rung of the ladder, or, where a row count within 1.5x of R has climbed already, at
    # that one's rung (under load R wanders, and each R alone sees few steps). From then on R keeps the
    # rung it runs and the speed of its recent steps there: a step's expected tokens (the steady state of
    # the acceptance learnt so far) over their measured mean time, or their own tokens per second where no
    # expectation is given. After `probe` steps, and then
    # every `period` steps at R, it runs the next rung, below and above in turn, for `probe` steps, and
    # moves there if those ran faster; after a move it tries the next rung the same way at once. Only a
    # step whose rows all decode (none joins with its prompt) and that follows a step of the same budget
    # counts: a row's first step after AR has no drafts yet. Any budget gives a greedy row the same
    # tokens, so the climb changes speed only.
    def __init__(self, rungs: list[int], probe: int = 6, period: int = 24, recent: int = 24,
                 tokens: Callable[[int, int], float] | None = None):
        self.rungs, self.probe, self.period, self.recent = rungs, probe, period, recent
        # tokens(R, budget): a step's expected tokens, to weigh against its measured time; None: the steps'
        # own tokens, which vary far more from step to step than their time does
        self.tokens = tokens
        self.at: dict[int, int] = {}  # R -> its rung (an index into rungs)
        self.trial: dict[int, list[int]] = {}  # R -> [the rung on trial, counted steps still to run]
        self.since: dict[int, int] = {}  # R -> counted steps at its rung since its last trial
        self.down: dict[int, bool] = {}  # R -> its next trial is the rung below
        self.steps: dict[tuple[int, int], collections.deque[tuple[int, float]]] = {}  # (R, rung) -> (tokens, s)
        self.last: int | None = None  # the budget of the last step, at any R
        self.ran: collections.Counter[tuple[int, int]] = collections.Counter()  # (R, budget) -> steps run

    def rate(self, R: int, i: int) -> float:  # tokens per second of R's recent counted steps at rung i
        steps = self.steps.get((R, i), ())
        if not steps:
            return 0.0
        seconds = sum(s for _, s in steps)
        if self.tokens is not None:  # the expected tokens of a step over its measured mean time
            return self.tokens(R, self.rungs[i]) * len(steps) / max(seconds, 1e-9)
        return sum(t for t, _ in steps) / max(seconds, 1e-9)

    def choose(self, R: int, start: Callable[[], int]) -> int:
        if R not in self.at:  # a row count near one already climbed starts where that one is; else the model's
            near = min(self.at, key=lambda r: abs(r - R), default=None)
            first = self.rungs[self.at[near]] if near and max(near, R) <= 1.5 * min(near, R) else start()
            self.at[R] = min(range(len(self.rungs)), key=lambda i: abs(self.rungs[i] - first))
            # the first trial once the start has its own `probe` steps: the model may be far off
            self.since[R], self.down[R] = max(self.period - self.probe, 0), True
        if R not in self.trial and self.since[R] >= self.period and len(self.rungs) > 1:
            step = -1 if self.down[R] else 1
            if not 0 <= self.at[R] + step < len(self.rungs):  # the ladder's end: the other way
                self.down[R], step = not self.down[R], -step
            self.trial[R] = [self.at[R] + step, self.probe]
            self.steps.pop((R, self.at[R] + step), None)  # measured afresh
        return self.rungs[self.trial[R][0] if R in self.trial else self.at[R]]

    def record(self, R: int, budget: int, tokens: int, seconds: float, clean: bool) -> None:
        # A step of R rows ran with this budget (choose's answer), emitted tokens and took seconds, end to end.
        settled, self.last = budget == self.last, budget
        self.ran[R, budget] += 1
        if not (settled and clean) or R not in self.at or budget not in self.rungs:
            return
        i = self.rungs.index(budget)
        self.steps.setdefault((R, i), collections.deque(maxlen=self.recent)).append((tokens, seconds))
        trial = self.trial.get(R)
        if trial and trial[0] == i:
            trial[1] -= 1
            if trial[1] == 0:
                del self.trial[R]
                if self.rate(R, i) > self.rate(R, self.at[R]):  # move, and try the next rung that way now
                    self.down[R], self.at[R], self.since[R] = i < self.at[R], i, self.period
                else:
                    self.down[R], self.since[R] = not self.down[R], 0
        elif i == self.at[R]:
            self.since[R] += 1


class Policy:
    # The server's budget per step: a cost model picks where each row count starts, and the climb
    # (Climb) moves from there by the measured speed of the steps themselves.
    # The cost model: curves: R -> seconds at widths ns, measured at a few row counts; between them t is
    # interpolated in R as well. The acceptance is estimated from the rows' own verify steps (a prior
    # worth `weight` verify-row observations first) and the table of budgets is refreshed every `every` verify
    # rows observed, and with each overhead update. A step costs
    # its forward and a fixed overhead besides (building the inputs, checking drafts, sending text), the
    # median of the last `recent` steps' measured time less the curve's forward: on a small model the
    # overhead dominates, and a budget chosen by the forward alone would be too narrow. The model misses
    # what the forward at launch does not show (the rows' real context, the work around a wide step's
    # head), which is why the climb has the last word.
    def __init__(self, ns: list[int], curves: dict[int, list[float]], G: int, prior: list[float],
                 weight: float = 50.0, every: int = 128, recent: int = 64, climb: Climb | None = None):
        self.ns, self.curves, self.G, self.every = ns, dict(sorted(curves.items())), G, every
        chance = (prior + [prior[-1]] * G)[:G]
        self.tried = [weight] * G  # draft i: checked once d_1..d_{i-1} held
        self.held = [weight * c for c in chance]  # ... and accepted too
        self.steps, self.table = 0, {}
        self.extra: collections.deque[float] = collections.deque(maxlen=recent)  # step seconds beyond the forward
        self.overhead, self.timings = 0.0, 0
        self.climb = climb or Climb(ladder(G), tokens=self.expected)

    def t(self, R: int, n: float) -> float:
        rs = list(self.curves)
        lo = max((r for r in rs if r <= R), default=rs[0])
        hi = min((r for r in rs if r >= R), default=rs[-1])
        t_lo, t_hi = (interpolate(self.ns, self.curves[r], n) for r in (lo, hi))
        if hi == lo:
            return t_lo * (R / lo if R > lo else 1.0)  # past the widest batch measured, in proportion
        return t_lo + (t_hi - t_lo) * (R - lo) / (hi - lo)

    def acceptance(self) -> list[float]:
        return [h / t for h, t in zip(self.held, self.tried)]

    def observe(self, k: int, a: int) -> None:
        # A verify row fed k drafts and a of them were accepted.
        for i in range(min(a + 1, k, self.G)):
            self.tried[i] += 1
            self.held[i] += i < a
        self.steps += 1
        if self.steps % self.every == 0:
            self.table = {}

    def timed(self, R: int, budget: int, n: int, seconds: float, tokens: int, clean: bool = True) -> None:
        # A step of R rows with this budget (the answer of self.budget(R)) fed n positions a row (the widest
        # row), emitted tokens and took this long, end to end; clean: no row joined with its prompt.
        self.extra.append(seconds - self.t(R, n))
        self.timings += 1
        if self.timings == 8 or self.timings % 32 == 0:  # the table is rebuilt only now and then
            self.overhead, self.table = max(0.0, statistics.median(self.extra)), {}
        self.climb.record(R, budget, tokens, seconds, clean)

    def expected(self, R: int, budget: int) -> float:
        # A step's expected tokens at R greedy verify rows under this budget: the budget rule's steady state
        # under the acceptance learnt so far (AR_STEP: one a row).
        if budget == AR_STEP:
            return float(R)
        return R * steady_state(self.acceptance(), self.G, budget, lambda n: 1.0)[0]

    def modelled(self, R: int) -> int:  # the cost model's positions per verify row at R rows, or AR_STEP
        if R not in self.table:
            self.table[R] = best_budget(self.acceptance(), self.G, lambda n: self.t(R, n) + self.overhead, ar=True)[0]
        return self.table[R]

    def budget(self, R: int) -> int:  # this step's positions per verify row at R rows, or AR_STEP
        return self.modelled(R) if self.G == 0 else self.climb.choose(R, lambda: self.modelled(R))
