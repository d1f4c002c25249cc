# The draft budget sized to the machine (docs/method.md §9, mars/budget.py). --draft-budget auto
# (budget.measured_budget) times a forward per width on the machine it runs on. On a small, busy CPU a
# single timing can be many times too slow: the chosen budget must not follow it. The timings come from
# a fake clock, so the test sees exactly which timing was the outlier. Then generate.py's auto budget, the
# budget rule's steady state, the server's policy and its climb.
import json
import random
import re

import pytest
import torch

from conftest import tiny_checkpoint, tiny_model
from generate import Options, decode_naive, main
from mars import budget
from mars.layout import budget_layout

MEASURE = budget.measure


def cost(n: int) -> float:  # seconds of a forward feeding n positions: a fixed part and a share per position
    return 0.010 + 0.0005 * n


class FakeClock:
    # Each timed forward takes cost(n) for the width n it fed (read off the embedding's input), times
    # `factor` for the timing numbered `outlier` (0-based, in the order they ran; None: no outlier).
    def __init__(self, outlier: int | None = None, factor: float = 30.0):
        self.t, self.calls, self.width, self.outlier, self.factor = 0.0, 0, 0, outlier, factor

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the end of a timing: the forward in between took its time
            self.t += cost(self.width) * (self.factor if self.calls // 2 - 1 == self.outlier else 1.0)
        return self.t


def measured(model, monkeypatch, clock: FakeClock, G: int = 3) -> tuple[int, list[int], list[float]]:
    # budget.measured_budget, its forwards timed on `clock`
    monkeypatch.setattr(budget, "measure", lambda *args, **kw: MEASURE(*args, **kw, timer=clock))
    hook = model.model.embed_tokens.register_forward_pre_hook(lambda m, args: setattr(clock, "width", args[0].shape[1]))
    try:
        return budget.measured_budget(model, 1, G)
    finally:
        hook.remove()


def rung(b: int, G: int = 3) -> int:  # the budget's place on the server's ladder
    rungs = budget.ladder(G)
    return min(range(len(rungs)), key=lambda i: abs(rungs[i] - b))


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_one_slow_timing_moves_the_budget_by_at_most_one_rung(model, monkeypatch):
    G = 3
    clean = FakeClock()
    expected = measured(model, monkeypatch, clean, G)[0]
    timings = clean.calls // 2
    assert timings >= 3 * len(budget.widths(G))  # several timings per width, not one or two
    assert expected == budget.best_budget(budget.PRIOR, G, lambda n: budget.interpolate(
        budget.widths(G), [cost(m) for m in budget.widths(G)], n))[0]
    assert 1 < expected < G * (G + 2)  # a budget in the middle, which an outlier could move either way
    for outlier in range(timings):  # the outlier at every timing in turn: the warm-up round and each width's
        got = measured(model, monkeypatch, FakeClock(outlier), G)[0]
        assert abs(rung(got) - rung(expected)) <= 1, (outlier, got, expected)


def test_the_seconds_reported_are_the_medians_and_rise_with_the_width(model, monkeypatch):
    # The widths' medians, each at most every wider one's: a narrow width slowed in every round (load while
    # it ran) is not cheaper than a wide one.
    seconds = budget.rising([0.5, 0.012, 0.013, 0.011, 0.02])
    assert seconds == [0.011, 0.011, 0.011, 0.011, 0.02]
    clock = FakeClock(outlier=len(budget.widths(3)) + 2)  # in the first timed round, the third width
    _, ns, seconds = measured(model, monkeypatch, clock)
    assert seconds == pytest.approx([cost(n) for n in ns])


# ---- --draft-budget auto in generate.py ----

@pytest.fixture
def ckpt(tmp_path):
    model, tok = tiny_checkpoint(tmp_path / "ckpt", spread=0, sharpen=40,  # confident: several tokens per step
                                 max_position_embeddings=128)
    return tmp_path / "ckpt", model, tok


def test_cli_draft_budget_auto_measures_this_machine_and_stays_exact(ckpt, capsys, monkeypatch):
    # --verify's default budget comes from t(n) measured at launch for the run's rows: wider when the
    # forward's cost is flat, narrower when each position costs its own share. The tokens stay greedy's.
    path, model, tok = ckpt
    p = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    greedy, _ = decode_naive(model, p, tok.mask_id, tok.stop_ids, Options(tau=1.0, B=4, max_new_tokens=12))
    chosen, rows = {}, []
    for name, cost in (("flat", lambda n: 1.0), ("steep", lambda n: float(n))):
        def measure(model, R, ns, context, reps, cost=cost):
            rows.append(R)
            return [cost(n) for n in ns]

        monkeypatch.setattr(budget, "measure", measure)
        main(["--ckpt", str(path), "--prompt", "hi", "--verify", "--max-new-tokens", "12", "--json", "--device", "cpu"])
        captured = capsys.readouterr()
        lines = [json.loads(line) for line in captured.out.splitlines()]
        assert lines[0]["output_ids"] == greedy
        chosen[name] = int(re.search(r"--draft-budget auto: (\d+) positions per row at 1 rows", captured.err)[1])
        assert lines[-1]["summary"]["draft_budget"] == chosen[name]
        assert chosen[name] == budget.best_budget(budget.PRIOR, 3, cost)[0]
    assert rows == [1, 1] and 1 <= chosen["steep"] < chosen["flat"] <= 15
    monkeypatch.setattr(budget, "measure", lambda *a, **kw: pytest.fail("measured a fixed budget"))
    main(["--ckpt", str(path), "--prompt", "hi", "--verify", "--max-new-tokens", "12", "--draft-budget", "5",
          "--json", "--device", "cpu"])
    assert "--draft-budget auto" not in capsys.readouterr().err


# ---- the budget sized to the machine (docs/method.md §9, budget.py) ----

def test_the_best_budget_follows_the_cost_of_width():
    G, acc = 3, [0.8, 0.7, 0.6]
    full = budget.steady_state(acc, G, 0, lambda n: 1.0)
    assert abs(full[1] - 16) < 1e-9  # the full B = 4 tree: 1 + 3 + 4 x 3 positions, every step
    # Free width: no budget beats the full tree. Width that costs its positions: a small budget wins.
    flat = budget.best_budget(acc, G, lambda n: 1.0)
    assert flat[1][0] == pytest.approx(full[0]) and flat[1][2] == pytest.approx(full[2])
    steep_n, steep = budget.best_budget(acc, G, lambda n: 1.0 + n)
    assert steep_n <= 4 and steep[2] > budget.steady_state(acc, G, 0, lambda n: 1.0 + n)[2]
    # The steady state against a simulation of the rule: draft i holds with chance acc[i - 1].
    g, k, tokens, fed, steps = torch.Generator().manual_seed(0), 0, 0, 0, 20000
    for _ in range(steps):
        drafts, sizes = budget_layout(acc[:k], G, 6)
        a = 0
        while a < drafts and torch.rand(1, generator=g).item() < acc[a]:
            a += 1
        tokens, fed, k = tokens + a + 1, fed + 1 + drafts + sum(sizes), sizes[a]
    want = budget.steady_state(acc, G, 6, lambda n: 1.0)
    assert tokens / steps == pytest.approx(want[0], rel=0.02) and fed / steps == pytest.approx(want[1], rel=0.02)


def test_the_best_budget_reads_every_budgets_layout_from_one_ranking():
    # best_budget weighs every budget 1 .. G (G + 2) in every state from one ranking per state: each layout
    # and each steady state is the one the rule itself (budget_layout, steady_state) gives at that budget.
    rng = random.Random(0)
    for G in (1, 3, 7, 12):
        conf = [rng.random() for _ in range(rng.randint(0, G))]
        most = G * (G + 2) + 3  # past the full tree too
        assert budget.every_budget(conf, G, most) == [budget_layout(conf, G, N) for N in range(1, most + 1)]
    acc, t = [0.8, 0.6, 0.5], lambda n: 1.0 + 0.05 * n
    for G in (3, 7):
        table = {N: budget.steady_state(acc, G, N, t) for N in range(1, G * (G + 2) + 1)}
        best = max(table, key=lambda N: table[N][2])
        chosen, state = budget.best_budget(acc, G, t)
        assert chosen == best and state == pytest.approx(table[best])


def test_the_server_policy_shrinks_the_budget_as_rows_grow_and_learns_the_acceptance():
    ns = [1, 2, 4, 8, 16, 32, 64, 128]
    curves = {R: [0.01 + 0.0001 * R * n for n in ns] for R in (1, 4, 16)}  # each position costs, more with R
    policy = budget.Policy(ns, curves, G=3, prior=[0.7, 0.55, 0.45], weight=10, every=8)
    assert policy.t(8, 16) == pytest.approx(0.01 + 0.0001 * 8 * 16)  # between measured batches: linear in R
    assert policy.t(32, 16) == pytest.approx(2 * (0.01 + 0.0001 * 16 * 16))  # past the widest: in proportion
    budgets = [policy.modelled(R) for R in (1, 2, 4, 8, 16)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    for _ in range(200):  # every draft holds: the acceptance rises toward 1; the chain after d_3 is enough
        policy.observe(3, 3)
    sure = budget.steady_state(policy.acceptance(), 3, policy.modelled(4), lambda n: policy.t(4, n))
    assert min(policy.acceptance()) > 0.9 and policy.modelled(4) == 6 and sure[0] > 3.5
    for _ in range(400):  # no draft holds: only the first is ever checked
        policy.observe(3, 0)
    unsure = budget.steady_state(policy.acceptance(), 3, policy.modelled(4), lambda n: policy.t(4, n))
    assert policy.acceptance()[0] < 0.4 and unsure[0] < 2 < sure[0]


def test_the_server_policy_adds_the_measured_step_overhead_to_the_forward():
    # A step costs its forward and a fixed overhead besides. Where the overhead dwarfs the forward, a
    # wider row is nearly free, so the budget must widen; the overhead is the steps' median excess.
    ns = [1, 2, 4, 8, 16]
    curves = {16: [0.001 + 0.0004 * n for n in ns]}  # at 16 rows a 16-wide forward costs 4x a 1-wide one
    policy = budget.Policy(ns, curves, G=3, prior=[0.7, 0.55, 0.45])
    narrow = policy.modelled(16)
    for i in range(7):
        policy.timed(16, narrow, 16, policy.t(16, 16) + 0.05 + 0.001 * i, 16)
    assert policy.overhead == 0.0 and policy.modelled(16) == narrow  # not yet: a few steps say little
    policy.timed(16, narrow, 4, policy.t(16, 4) + 0.2, 16)  # one slow step moves a median little
    assert policy.overhead == pytest.approx(0.0535)
    wide = budget.best_budget(policy.acceptance(), 3, lambda n: policy.t(16, n) + policy.overhead)[0]
    assert policy.modelled(16) == wide > narrow
    for _ in range(64):  # steps faster than the curve's forward: no negative overhead
        policy.timed(16, narrow, 16, 0.0, 16)
    assert policy.overhead == 0.0 and policy.modelled(16) == narrow


def climb_world(speed, start: int, steps: int, seed: int = 0):
    # A server whose steps at 4 rows emit speed[budget] tokens per second, give or take 10%: the climb
    # starts at `start` and runs `steps` steps. -> (the climb, the budgets in the order they ran).
    rng = random.Random(seed)
    climb, ran = budget.Climb(budget.ladder(3)), []
    for _ in range(steps):
        b = climb.choose(4, lambda: start)
        climb.record(4, b, round(speed[b] * 0.1 * rng.uniform(0.9, 1.1)), 0.1, clean=True)
        ran.append(b)
    return climb, ran


def test_the_climb_finds_the_fastest_budget_from_a_far_start_and_stays_there():
    rungs = budget.ladder(3)
    assert rungs[0] == budget.AR_STEP and rungs[-1] == 15 and rungs[1:] == sorted(set(rungs[1:]))
    for best, start in ((budget.AR_STEP, 11), (4, budget.AR_STEP), (15, 1)):
        # tokens per second fall by 12% a rung away from the best one
        speed = {b: 300 * 0.88 ** abs(rungs.index(b) - rungs.index(best)) for b in rungs}
        climb, ran = climb_world(speed, start, 1200)
        assert climb.rungs[climb.at[4]] == best, (best, start)
        assert ran[-600:].count(best) > 0.7 * 600, (best, start)  # trials of its neighbours are the rest
        assert set(ran[-600:]) <= {best, *rungs[max(rungs.index(best) - 1, 0):rungs.index(best) + 2]}


def test_the_climb_weighs_expected_tokens_against_measured_time():
    # The tokens a step emits swing widely (here 0 to twice their mean); their mean, the budget rule's steady
    # state, is known. Weighed against each rung's measured time, the climb finds the fastest rung anyway.
    rungs, rng = budget.ladder(3), random.Random(1)
    mean = {b: 4 * (1 + i) ** 0.5 for i, b in enumerate(rungs)}  # more tokens a step, less and less more
    cost = {b: 0.1 * (1 + 0.25 * i) for i, b in enumerate(rungs)}  # and each rung costs more time
    speed = {b: mean[b] / cost[b] for b in rungs}
    near = {b for b in rungs if speed[b] >= 0.97 * max(speed.values())}  # the best, and rungs within 3% of it
    assert len(near) < len(rungs) / 2 and 15 not in near
    climb, ran = budget.Climb(rungs, tokens=lambda R, b: mean[b]), []
    for _ in range(1200):
        b = climb.choose(4, lambda: 15)
        climb.record(4, b, round(rng.uniform(0, 2) * mean[b]), cost[b] * rng.uniform(0.97, 1.03), clean=True)
        ran.append(b)
    assert climb.rungs[climb.at[4]] in near and sum(b in near for b in ran[-600:]) > 0.7 * 600


def test_the_climb_counts_only_settled_clean_steps():
    # A step right after the budget changed (a row's first step after AR has no drafts) and a step in which
    # a row joined with its prompt say nothing about a budget's speed.
    climb = budget.Climb(budget.ladder(3), probe=2, period=3)
    assert climb.choose(2, lambda: 6) == 6 and climb.since[2] == 1  # a trial once 6 has 2 steps of its own
    climb.record(2, 6, 20, 0.1, clean=True)  # the first step of any run: no step before it to follow
    climb.record(2, 6, 20, 0.1, clean=False)
    assert climb.since[2] == 1 and climb.rate(2, climb.at[2]) == 0.0
    climb.record(2, 6, 20, 0.1, clean=True)
    assert climb.choose(2, lambda: 6) == 6  # one counted step: no trial yet
    climb.record(2, 6, 20, 0.1, clean=True)
    assert climb.since[2] == 3 and climb.rate(2, climb.at[2]) == pytest.approx(200)
    trial = climb.choose(2, lambda: 6)
    assert trial == 4 and climb.choose(2, lambda: 6) == 4  # the rung below, until its steps are in
    climb.record(2, 4, 30, 0.1, clean=True)  # the change's step: not counted
    assert climb.trial[2] == [climb.rungs.index(4), 2]
    climb.record(2, 4, 30, 0.1, clean=True)
    climb.record(2, 4, 30, 0.1, clean=True)  # faster: it moves, and tries the next rung down at once
    assert 2 not in climb.trial and climb.rungs[climb.at[2]] == 4 and climb.choose(2, lambda: 6) == 3
    assert climb.ran[2, 4] == 3 and climb.ran[2, 6] == 4
    for _ in range(3):  # slower: it stays at 4, and tries the rung above next time
        climb.record(2, 3, 10, 0.1, clean=True)
    assert climb.rungs[climb.at[2]] == 4 and not climb.down[2] and climb.choose(2, lambda: 6) == 4
    # A row count near a climbed one starts at its rung; one far from every climbed one, at the model's.
    assert climb.choose(3, lambda: 15) == 4 and climb.choose(8, lambda: 15) == 15


def test_forward_cost_times_the_head_beside_the_curve_and_choose_still_reads_it(ckpt, tmp_path):
    from tools import forward_cost

    out = tmp_path / "cost.json"
    forward_cost.main(["--ckpt", str(ckpt[0]), "--dtypes", "float32", "--rows", "1", "--widths", "1", "2", "4",
                       "--reps", "1", "--head-rows", "1", "8", "--out", str(out)])
    report = json.loads(out.read_text())
    head = report["head"]["ckpt"]["float32"]
    assert head["rows"] == [1, 8] and len(head["seconds"]) == 2 and min(head["seconds"]) > 0
    assert list(report["models"]["ckpt"]["float32"]) == ["1"]  # the curves hold row counts only
    forward_cost.main(["--choose", "ckpt", "--choose-dtype", "float32", "--block-size", "4", "--out", str(out)])
    assert json.loads(out.read_text())["budget"]["ckpt"]["float32"]["B=4"]["rows"]["1"]["budget"] >= 0
    # Another model merged in: each keeps the settings it was measured with; the one measured again loses the
    # budget chosen from its old curves.
    forward_cost.main(["--demo", "--dtypes", "float32", "--rows", "1", "--widths", "1", "--reps", "1", "--out",
                       str(out)])
    report = json.loads(out.read_text())
    assert report["measured_with"]["ckpt"]["settings"]["widths"] == [1, 2, 4]
    assert report["measured_with"]["demo"]["settings"]["widths"] == [1] and "ckpt" in report["budget"]
    forward_cost.main(["--ckpt", str(ckpt[0]), "--dtypes", "float32", "--rows", "1", "--widths", "1", "--reps", "1",
                       "--out", str(out)])
    assert "ckpt" not in json.loads(out.read_text())["budget"]


def test_verify_with_one_slot_is_greedy_and_measures_nothing(ckpt, monkeypatch, capsys):
    # B = 1 has no masks, so no drafts: --verify decodes greedy, and the budget has nothing to size.
    path, model, tok = ckpt
    monkeypatch.setattr(budget, "measure", lambda *a, **kw: pytest.fail("measured with no masks"))
    p = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    greedy, _ = decode_naive(model, p, tok.mask_id, tok.stop_ids, Options(tau=1.0, B=4, max_new_tokens=12))
    main(["--ckpt", str(path), "--prompt", "hi", "--verify", "--block-size", "1", "--max-new-tokens", "12",
          "--json", "--device", "cpu"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["output_ids"] == greedy and lines[-1]["summary"]["tokens_per_forward"] == 1.0
    assert budget.best_budget(budget.PRIOR, 0, lambda n: 0.1 * n) == (0, (1.0, 1.0, 10.0))


def test_the_budget_may_be_plain_ar_where_drafts_cost_more_than_they_return():
    # With ar=True the rule also weighs plain AR (one position, one token): chosen where each position costs its
    # own share and drafts rarely hold, never where width is free.
    steep, flat = (lambda n: 0.1 * n), (lambda n: 0.1)
    assert budget.best_budget([0.3, 0.2, 0.1], 3, steep, ar=True) == (budget.AR_STEP, (1.0, 1.0, 10.0))
    assert budget.best_budget([0.3, 0.2, 0.1], 3, steep)[0] >= 1  # without ar, some budget of drafts
    assert budget.best_budget(budget.PRIOR, 3, flat, ar=True)[0] >= 1
