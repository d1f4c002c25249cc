# mars/compiled.py: --compile, the decode step at static shapes under torch.compile. Its tokens are the
# eager path's and the uncached reference's exactly (float32, tiny random models), every step of a decode
# after the prompt's runs compiled at one shape, and a second decode of that shape compiles nothing.
# Inductor takes seconds per graph on 2 cores: the file shares one model, and so its graphs, across tests
# (threshold and chain rows share a width), and runs the wider checks on the same static step, eagerly.
import contextlib
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import tiny_checkpoint, tiny_model
from generate import Options, decode, decode_naive
from mars import cli, compiled, prompts, quantize, serve
from mars.adapter import attach
from mars.layout import Stats, step_inputs

MASK = 63  # the tiny models' mask id: their last vocabulary row
STOPS = {5, 13}  # some rows stop early, others run to max_new_tokens


def some_prompts(lengths=(3, 17, 40, 1), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK - 1, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return tiny_model(1)


@contextmanager
def spied(model, run=None):
    # Every call of the model's static step: (x's shape, a layer's cache shape). run: the step to call
    # (compiled.step runs it eagerly); by default the compiled one.
    inner, calls = run or compiled.compiled(model), []
    compiled.COMPILED[model] = lambda m, x, k, v: calls.append((tuple(x.shape), tuple(k[0].shape))) or inner(m, x, k, v)
    try:
        yield calls
    finally:
        del compiled.COMPILED[model]
        if run is None:
            compiled.COMPILED[model] = inner


def both(model, ps, opts, run=None):
    # (eager decode, compiled decode, the compiled step's calls), each with its stats
    eager_stats, static_stats = Stats(), Stats()
    eager = decode(model, ps, MASK, STOPS, opts, stats=eager_stats)
    with spied(model, run) as calls:
        static = decode(model, ps, MASK, STOPS, replace(opts, compile=True), stats=static_stats)
    assert static_stats == eager_stats
    return eager, static, calls


def one_shape_after_the_prompt(calls, forwards) -> bool:
    # Every step after the prompt's runs compiled (the prompt's too where it fits in W), at one shape while
    # rows finish and leave the batch.
    return len(calls) >= max(forwards) - 1 and len(set(calls)) == 1


@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_compiled_threshold_rows_equal_eager_and_the_reference(model, tau):
    ps = some_prompts()
    opts = Options(tau=tau, B=4, max_new_tokens=30)
    eager, static, calls = both(model, ps, opts)
    assert static == eager
    assert static[0] == [decode_naive(model, p, MASK, STOPS, opts)[0] for p in ps]
    assert len(set(static[1])) > 1  # rows finished at different steps
    assert one_shape_after_the_prompt(calls, static[1]), calls


@pytest.mark.parametrize("layout", ["tree", "chain"])
def test_compiled_verify_rows_equal_eager_and_greedy(model, layout):
    ps = some_prompts()
    opts = Options(B=4, max_new_tokens=30, verify=True, layout=layout)
    eager, static, calls = both(model, ps, opts)
    assert static == eager
    greedy = Options(tau=1.0, B=4, max_new_tokens=30)
    assert static[0] == [decode_naive(model, p, MASK, STOPS, greedy)[0] for p in ps]
    assert one_shape_after_the_prompt(calls, static[1]), calls


def test_a_second_decode_of_the_same_shapes_compiles_nothing(model):
    opts = Options(tau=0.9, B=4, max_new_tokens=30, compile=True)
    decode(model, some_prompts(seed=2), MASK, STOPS, opts)  # compiles its shape, unless a test above did
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    with spied(model) as calls:  # other prompts, the same batch size and cache size
        out, forwards = decode(model, some_prompts((5, 30, 33, 2), seed=3), MASK, STOPS, opts)
    assert max(forwards) > 10 and len(calls) == max(forwards) - 1
    assert counters["stats"]["unique_graphs"] == graphs and counters["frames"]["total"] == frames
    # ... on the same buffers, at the addresses a CUDA graph was recorded at (each decode's kept alive here, so
    # that a new one could not land there), what earlier decodes left in them changing no token, a NaN included
    with torch.inference_mode():  # as decode() made them
        compiled.LAST[model][1].k[:, :, :, -1] = float("nan")
    seen, inner = [], compiled.compiled(model)
    compiled.COMPILED[model] = lambda m, x, k, v: seen.append(k[0]) or inner(m, x, k, v)
    try:
        runs = [decode(model, some_prompts((5, 30, 33, 2), seed=3), MASK, STOPS, opts)[0] for _ in range(2)]
    finally:
        compiled.COMPILED[model] = inner
    assert len({k.data_ptr() for k in seen}) == 1
    assert runs[0] == runs[1] == out == decode(model, some_prompts((5, 30, 33, 2), seed=3), MASK, STOPS,
                                                replace(opts, compile=False))[0]


@pytest.mark.parametrize("kw", [dict(tau=0.5, B=3), dict(verify=True, B=3), dict(verify=True, draft_budget=5),
                                dict(tau=0.7, temperature=0.8, top_p=0.9), dict(verify=True, temperature=0.8)])
def test_the_static_step_equals_eager_at_every_batch_size(kw):
    # The static shapes alone (compiled.step run eagerly): widths that are not a power of two, a draft
    # budget, sampling (the same draws from the same seed), batches of 1 to 5 ragged prompts.
    model = tiny_model(2)
    for R in range(1, 6):
        ps = some_prompts([1, 40, 7, 22, 3][:R], seed=R)
        opts = Options(max_new_tokens=20, **kw)
        eager_stats, static_stats = Stats(), Stats()
        eager = decode(model, ps, MASK, STOPS, opts, torch.Generator().manual_seed(R), stats=eager_stats)
        with spied(model, compiled.step) as calls:
            static = decode(model, ps, MASK, STOPS, replace(opts, compile=True), torch.Generator().manual_seed(R),
                            stats=static_stats)
        assert static == eager and static_stats == eager_stats, (R, kw)
        assert one_shape_after_the_prompt(calls, static[1]), calls


def test_a_prompt_longer_than_half_the_cache_decodes():
    # new_cache holds the longest prompt, its new tokens and one step: a long prompt with few new tokens
    # fills most of it, and the prefill, which feeds every row, has no pad columns to keep clear.
    model = tiny_model(2)
    ps = some_prompts([70, 9])  # S = pow2(70 + 4 + W) = 128 < 2 x 70: W = 1 (AR), 16 (verify at B = 3)
    for opts in (Options(tau=1.0, max_new_tokens=4), Options(verify=True, B=3, max_new_tokens=4)):
        assert compiled.new_cache(model, ps, opts).max_len == 128
        with spied(model, compiled.step) as calls:
            static = decode(model, ps, MASK, STOPS, replace(opts, compile=True))
        assert calls and static == decode(model, ps, MASK, STOPS, opts)


def test_rows_that_left_a_static_cache_keep_no_pad_columns():
    # A row that finished keeps its buffer row, fed pads from then on and never read again: the rows still
    # decoding may fill the cache up to W columns from its end, however wide their step.
    model = tiny_model(1)
    kv = compiled.StaticCache(model.config, 2, 128)
    kv.set_lengths([118, 20])
    kv.keep_rows([0])  # row 1 finished
    seq = some_prompts([121])[0]
    inp = step_inputs([seq[:119]], [3], [None], kv, MASK, [False], "cpu")  # a threshold row: 1 token, 2 masks
    compiled.COMPILED[model] = compiled.step  # the static step, eagerly
    try:
        with torch.no_grad():
            h = compiled.hidden(model, inp, kv, 8)  # 118 + 8 <= 128, though 118 + 3 + 8 > 128
            assert h.shape == (1, 3, model.config.hidden_size)
            kv.set_lengths([121])
            inp = step_inputs([seq + [1]], [3], [None], kv, MASK, [False], "cpu")
            with pytest.raises(RuntimeError, match="KV cache overflow: a row of 121 writes 8 columns, in max_len 128"):
                compiled.hidden(model, inp, kv, 8)
    finally:
        del compiled.COMPILED[model]


def test_compile_needs_the_cursor_cache():
    for cache in ("block", "none"):
        with pytest.raises(AssertionError, match="compile needs cache=cursor"):
            decode(tiny_model(), [[1, 2]], MASK, STOPS, Options(cache=cache, K=4, compile=True))
        with pytest.raises(ValueError, match="--compile with --cache"):
            prompts.check_settings(prompts.Settings(prompt=["hi"], cache=cache, compile=True))
    assert cli.parse(prompts.Settings, ["--prompt", "hi", "--compile"], "").compile
    assert cli.parse(serve.Settings, ["--compile"], "").compile


@pytest.mark.parametrize("B", [2, 3, 4, 5, 8])
def test_the_auto_budget_under_compile_fills_the_steps_width(B, monkeypatch):
    # A compiled verify step feeds its width whatever the budget: --draft-budget auto takes the most drafts
    # that width holds, never fewer than measured, never past the full tree.
    full = B * B - 1
    for budget in range(1, full + 1):
        most = compiled.fullest_budget(B, budget)
        W = compiled.width(Options(B=B, verify=True, draft_budget=budget))
        assert budget <= most <= full and compiled.width(Options(B=B, verify=True, draft_budget=most)) == W
        assert most == full or compiled.width(Options(B=B, verify=True, draft_budget=most + 1)) > W
    monkeypatch.setattr(prompts.budget, "measured_budget", lambda model, R, G: (1, [1, 2], [1e-3, 2e-3]))
    s = prompts.Settings(prompt=["hi"], verify=True, block_size=B)
    assert prompts.sized_budget(s, None, 1).draft_budget == "1"
    assert prompts.sized_budget(replace(s, compile=True), None, 1).draft_budget == str(
        compiled.fullest_budget(B, 1))


def test_a_sampled_auto_budget_is_the_fixed_one_so_that_its_seed_repeats(monkeypatch, capsys):
    # The budget sets a sampled verify step's draws: measured, it would make a --seed's text follow the load.
    monkeypatch.setattr(prompts.budget, "measured_budget", lambda *a: pytest.fail("measured a sampled run's budget"))
    s = prompts.Settings(prompt=["hi"], verify=True, block_size=4, temperature=0.7)
    assert prompts.sized_budget(s, None, 1).draft_budget == str(prompts.budget.DEFAULT_BUDGET)
    assert "a sampled run's fixed budget, so that its --seed repeats its text" in capsys.readouterr().err
    assert prompts.sized_budget(replace(s, compile=True), None, 1).draft_budget == "12"  # as eager: the same draws
    assert prompts.sized_budget(replace(s, block_size=3), None, 1).draft_budget == "8"  # at most the full tree


def test_compile_on_a_cpu_without_a_cpp_compiler_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    from torch._inductor import cpp_builder

    import generate

    tiny_checkpoint(tmp_path / "ckpt")

    def no_compiler():
        raise RuntimeError("No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setattr(generate.Transformer, "from_pretrained", lambda *a, **kw: pytest.fail("loaded weights"))
    monkeypatch.setattr(serve, "load_model", lambda *a, **kw: pytest.fail("loaded weights"))
    fix = r"--compile on the CPU needs a C\+\+ compiler to build the compiled step \(No working .*\); install g\+\+"
    with pytest.raises(SystemExit, match=fix):
        generate.main(["--ckpt", str(tmp_path / "ckpt"), "--prompt", "hi", "--compile", "--device", "cpu"])
    with pytest.raises(ValueError, match=fix):
        serve.launch(cli.parse(serve.Settings, ["--ckpt", str(tmp_path / "ckpt"), "--compile", "--device", "cpu"], ""),
                     engine_thread=False)


TEXTS = ["hello", "count to ten please", "a", "tell me a story about a cat", "ok", "what is 2 + 2?"]
JOINS = [0, 0, 2, 3, 3, 7]  # the step each request is submitted at


def served(tok, path, compile: bool, calls=None, warm: bool = False, block_size: int = 4,
           gated: bool = False) -> list[list[int]]:
    # The engine's outputs for TEXTS, joining at JOINS: threshold and verify rows share steps, the load moves
    # tau. calls: record the static step's calls, run eagerly (compiled.step); else the compiled step runs.
    # gated: the model has a gated adapter (adapted).
    model = tiny_model(0, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    if gated:
        model = adapted(model, tok.mask_id)
    s = serve.Settings(ckpt=str(path), max_rows=4, max_len=128, max_tokens=24, tau_min=0.5, draft_budget="0",
                       compile=compile, block_size=block_size)
    engine = serve.Engine(model, tok, s)
    reqs = [serve.Request(prompt=tok.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True),
                          max_tokens=24, temperature=0.0, stop=[], threshold=0.6 if i % 3 == 1 else None,
                          stream=False) for i, t in enumerate(TEXTS)]
    if warm:  # as serve.launch does: outside inference mode, which warm() enters as the engine's thread does
        before = counters["stats"]["unique_graphs"]
        engine.warm()
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > before
    with torch.inference_mode(), spied(model, compiled.step) if calls is not None else contextlib.nullcontext([]) \
            as seen:
        for step in range(200):
            for r, at in zip(reqs, JOINS):
                if at == step:
                    engine.submit(r)
            with engine.lock:
                engine.admit()
            if step > max(JOINS) and not engine.running():
                break
            engine.step()
    if calls is not None:
        calls += seen
    if warm:  # every width a step took was compiled before the first request
        assert counters["stats"]["unique_graphs"] == graphs
    return [r.out for r in reqs]


def test_the_server_runs_its_steps_at_static_shapes(tmp_path):
    # The engine's rows come and go. Its outputs with --compile equal those without, step for step, and its
    # static steps run over all --max-rows slots at a handful of shapes.
    _, tok = tiny_checkpoint(tmp_path)
    calls = []
    static = served(tok, tmp_path, True, calls)
    assert static == served(tok, tmp_path, False)
    assert all(len(o) > 1 for o in static)
    assert calls and {x[0] for x, _ in calls} == {4} and len(set(calls)) <= 3, set(calls)


def test_a_warm_server_compiles_nothing_while_it_serves(tmp_path):
    # serve.py --compile compiles every width before it listens (Engine.warm): requests then wait for no
    # compile, and the pads the warm-up wrote change no output. B = 2 keeps it to two widths (1 and 4).
    _, tok = tiny_checkpoint(tmp_path)
    engine = serve.Engine(tiny_model(0, vocab_size=tok.vocab_size), tok, serve.Settings(ckpt=str(tmp_path),
                                                                                      block_size=2, compile=True))
    assert engine.widths() == [1, 4]
    assert served(tok, tmp_path, True, warm=True, block_size=2) == served(tok, tmp_path, False, block_size=2)


def test_a_warm_server_with_a_gated_adapter_compiles_nothing_while_it_serves(tmp_path):
    # --compile on a server with a gated adapter: its outputs are eager's, and after the warm-up, which is the
    # adapter's first forward (a fixed budget measures nothing first), no request compiles anything.
    _, tok = tiny_checkpoint(tmp_path)
    assert served(tok, tmp_path, True, warm=True, gated=True) == served(tok, tmp_path, False, gated=True)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compiled_steps_of_a_quantized_model_equal_eager(kind):
    # --compile with --quantize: the static step compiles with the weight-only kernels (mars/quantize.py) in it,
    # and verify rows stay the quantized model's greedy tokens (float32, the uncached reference).
    with torch.no_grad():
        m = quantize.quantize(tiny_model(1), kind)
    ps = some_prompts()
    opts = Options(B=4, max_new_tokens=20, verify=True)
    eager, static, calls = both(m, ps, opts)
    assert static == eager
    greedy = Options(tau=1.0, B=4, max_new_tokens=20)
    assert static[0] == [decode_naive(m, p, MASK, STOPS, greedy)[0] for p in ps]
    assert one_shape_after_the_prompt(calls, static[1]), calls


def adapted(m=None, mask_id: int = MASK):
    # a tiny model with a gated adapter whose B is not zero (a fresh one's is: it would change nothing)
    m = m or tiny_model(1)
    with torch.no_grad():
        for p in attach(m, mask_id).B.values():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    return m


def test_a_gated_adapters_first_forward_compiled_is_one_graph_and_makes_nothing_in_it():
    # The adapter's float32 copies (kept) are made before the step, never by it: made inside, they would be
    # the graph's outputs, which on CUDA the next replay overwrites, and the step would recompile on them; its
    # weights' versions are checked there too, where inside they would break the graph. Here the compiled step
    # is the adapter's first forward (every prompt fits the step's width), and the step stays one graph.
    m, twin = adapted(), adapted()
    ps, opts = some_prompts(lengths=(3, 8, 5)), Options(tau=0.6, B=4, max_new_tokens=12)
    graphs = counters["stats"]["unique_graphs"]
    with spied(m) as calls:
        static = decode(m, ps, MASK, STOPS, replace(opts, compile=True))[0]
    assert len(calls) > 2 and len(set(calls)) == 1 and m.adapter.kept
    assert counters["stats"]["unique_graphs"] - graphs <= 1  # one (none where an earlier test made it)
    assert static == decode(twin, ps, MASK, STOPS, opts)[0]


def test_compiled_steps_of_a_gated_adapter_equal_eager_and_compile_once():
    # --compile with the gated adapter (mars/adapter.py): its hooks trace into the static step, which runs every
    # row and folds the gate in (no count of the masks: a count is a data-dependent shape, so a graph break and
    # a recompile per count). Verify rows stay the base model's greedy tokens (float32, the uncached reference),
    # and a second decode of the same shapes compiles nothing.
    base, m = tiny_model(1), adapted()
    ps = some_prompts()
    for opts in (Options(tau=0.6, B=4, max_new_tokens=20), Options(B=4, max_new_tokens=20, verify=True)):
        graphs = counters["stats"]["unique_graphs"]
        eager, static, calls = both(m, ps, opts)
        assert static == eager and counters["stats"]["unique_graphs"] - graphs <= 1  # no graph break
        assert one_shape_after_the_prompt(calls, static[1]), calls
    greedy = Options(tau=1.0, B=4, max_new_tokens=20)
    assert static[0] == [decode_naive(base, p, MASK, STOPS, greedy)[0] for p in ps]
    graphs = counters["stats"]["unique_graphs"]
    assert decode(m, some_prompts(seed=4), MASK, STOPS, replace(opts, compile=True))[0]
    assert counters["stats"]["unique_graphs"] == graphs
    threshold = Options(tau=0.6, B=4, max_new_tokens=20)  # the adapter changes the drafts
    assert decode(m, ps, MASK, STOPS, threshold)[0] != decode(base, ps, MASK, STOPS, threshold)[0]
