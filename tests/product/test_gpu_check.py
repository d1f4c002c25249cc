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
    assert list(modes) == ["ar", "mars", "mars+prune", "1-call", "self+teacher", "adapter"]
    assert modes["adapter"]["state_mb"] < modes["mars+prune"]["state_mb"] < modes["self+teacher"]["state_mb"]
    assert modes["mars+prune"]["columns"] < modes["mars"]["columns"] == 2 * modes["ar"]["columns"]
    assert all(any("scaled_dot_product" in k for k in m["sdpa"]) for m in modes.values())  # the backend is named
    assert {(x["batch"], x["method"]) for x in r["bench"]["results"]} >= {(1, "AR + KV cache"), (2, "MARS cursor")}
    c = r["compile"]
    assert c["compiled_ms"] > 0 and c["max_abs_logit_diff"] <= 1e-4 * max(1.0, c["logit_scale"])
    assert not [k for k in ("tests", "bench_train", "bench", "compile") if "error" in r[k]]


def test_gpu_check_records_a_failed_step_and_runs_the_rest(tmp_path, monkeypatch):
    # A step that fails leaves its error in the file; the steps after it still run and are written.
    def broken(argv):
        raise RuntimeError("out of memory (planted)")

    monkeypatch.setattr(gpu_check.bench_train, "main", broken)
    out = tmp_path / "gpu.json"
    gpu_check.main(["--device", "cpu", "--quick", "--no-tests", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["bench_train"] == {"error": "RuntimeError: out of memory (planted)"}
    assert r["bench"]["results"] and r["compile"]["compiled_ms"] > 0 and "tests" not in r


def test_gpu_check_collects_only_the_cuda_marked_files():
    # The GPU machine need not have what the other tests import, so only the marked files are collected.
    files = gpu_check.cuda_test_files()
    assert "tests/spec/test_device.py" in files and not any("serve" in f or "lm_eval" in f for f in files)
