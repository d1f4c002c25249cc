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
