# tools/gpu_check.py is meant for a GPU; its CI-sized form runs every step on the CPU, so the script
# cannot rot between GPU runs.
import json

from tools import gpu_check


def test_gpu_check_quick_on_cpu_runs_every_step(tmp_path):
    out = tmp_path / "gpu.json"
    gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["device"].startswith("cpu") and r["torch"]
    assert r["tests"]["returncode"] == 0 and r["tests"]["passed"] >= 4 and "failed" not in r["tests"]
    modes = r["bench_train"]["modes"]
    assert list(modes) == ["ar", "mars", "mars+prune", "1-call", "adapter"]
    assert modes["adapter"]["state_mb"] < modes["mars+prune"]["state_mb"]
    assert modes["mars+prune"]["columns"] < modes["mars"]["columns"] == 2 * modes["ar"]["columns"]
    assert all(any("scaled_dot_product" in k for k in m["sdpa"]) for m in modes.values())  # the backend is named
    assert {(x["batch"], x["method"]) for x in r["bench"]["results"]} >= {(1, "AR + KV cache"), (2, "MARS cursor")}
    c = r["compile"]
    assert c["compiled_ms"] > 0 and c["max_abs_logit_diff"] <= 1e-4 * max(1.0, c["logit_scale"])
    assert not [k for k in ("tests", "bench_train", "bench", "compile") if "error" in r[k]]


def test_gpu_check_records_a_failed_step_and_runs_the_rest(tmp_path, monkeypatch):
    # A step that fails leaves its error in the file; the steps after it still run and are written.
    tool = gpu_check.tool

    def bad_training_step(module, args, out):  # an odd --seq-len, which bench_train refuses
        return tool(module, [*args, "--seq-len", "33"] if module == "tools.bench_train" else args, out)

    monkeypatch.setattr(gpu_check, "tool", bad_training_step)
    out = tmp_path / "gpu.json"
    gpu_check.main(["--device", "cpu", "--quick", "--no-tests", "--out", str(out)])
    r = json.loads(out.read_text())
    assert "not a multiple of --block-size" in r["bench_train"]["error"] and "modes" not in r["bench_train"]
    assert r["bench"]["results"] and "error" not in r["bench"] and r["compile"]["compiled_ms"] > 0
    assert "tests" not in r


def test_gpu_check_collects_only_the_cuda_marked_files():
    # The GPU machine need not have what the other tests import, so only the marked files are collected.
    files = gpu_check.cuda_test_files()
    assert "tests/spec/test_device.py" in files and not any("serve" in f or "lm_eval" in f for f in files)


def test_bench_train_keeps_its_timings_when_a_probe_fails(tmp_path, monkeypatch, capsys):
    # The timings are in the file before the probes run; a probe that fails leaves None in its column,
    # its error under "errors", and the table prints a dash there.
    from tools import bench_train

    def failing(model, batch, name, s, autocast):
        if name == "mars":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")
        return 1.0

    monkeypatch.setattr(bench_train, "logits_mb", failing)
    out = tmp_path / "bt.json"
    r = bench_train.main(["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["modes"]["mars"]["logits_mb"] is None and r["modes"]["ar"]["logits_mb"] == 1.0
    assert r["modes"]["mars"]["fwd_bwd_ms"] > 0 and r["modes"]["mars"]["saved_mb"] > 0
    assert list(r["errors"]) == ["mars logits_mb"] and "planted" in r["errors"]["mars logits_mb"]
    table = capsys.readouterr().out
    row = next(line.split() for line in table.splitlines() if line.startswith("mars ") and ":" not in line)
    assert row[11] == "-" and row[12] == f"{r['modes']['mars']['state_mb']:.0f}"  # logits MB, then state MB
