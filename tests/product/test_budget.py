# --draft-budget auto (budget.measured_budget) times a forward per width on the machine it runs on. On a
# small, busy CPU a single timing can be many times too slow: the chosen budget must not follow it. The
# timings come from a fake clock, so the test sees exactly which timing was the outlier.
import pytest

from conftest import tiny_model
from mars import budget

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
