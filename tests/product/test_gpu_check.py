# tools/gpu_check.py is meant for a GPU; its CI-sized form runs every stage on the CPU, so the script cannot rot
# between GPU runs. The runner's promises: each stage's result (or error) is in the file as soon as the stage ends,
# a stage that fails or hangs costs only itself, and what it saved before it failed stays.
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mars import cli
from tools import gpu_check, gpu_stages


def numbers(x):
    if isinstance(x, dict):
        return [n for v in x.values() for n in numbers(v)]
    if isinstance(x, list):
        return [n for v in x for n in numbers(v)]
    return [x] if isinstance(x, float) else []


def test_gpu_check_quick_on_cpu_runs_every_stage(tmp_path):
    out = tmp_path / "gpu.json"
    gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["device"].startswith("cpu") and r["torch"] == gpu_check.torch.__version__
    st = r["stages"]
    assert list(st) == list(gpu_check.TIMEOUTS) and {x["status"] for x in st.values()} == {"ok"}, st
    assert all(math.isfinite(n) for n in numbers(st))
    calls = st["env"]["attend_calls"]  # the training's causal and masked calls and the decode steps', each named
    assert any(k.startswith("train mars+prune") and "mask" in k for k in calls) and any("causal" in k for k in calls)
    assert all(c["picked"] in ("FLASH_ATTENTION", "MATH") for c in calls.values()) and st["env"]["sdpa_priority"]
    cases = st["nan"]["cases"]  # cuDNN, which the CPU lacks, is tried and its error kept
    assert len(cases) == 4 and all(row["condition"] and row["attend"]["ok"] and row["attend, CUDA's path"]["ok"]
                                   and "error" in row["cudnn alone"] for row in cases.values())
    assert st["nan"]["ok"] and st["nan"]["cuda_tests"]["passed"] == 1
    for kind in ("eager", "compiled"):
        assert {n: m["finite"] and m["ms_per_step"] > 0 for n, m in st["train"][kind].items()} == {
            "ar": True, "mars+prune": True}
    b = st["bisect"]
    assert b["first_failure"] is None and b["cuda_launch_blocking"] == "1" and len(b["phases"]) == 10
    assert st["trainpy"]["steps"] == 4 and st["trainpy"]["evals"] == 3 and st["trainpy"]["checkpoints"]
    d = st["decode"]
    assert len(d["eager"]) == 6 and all(x["tokens_per_s"] > 0 and x["tokens_per_forward"] >= 1
                                        for x in d["eager"].values())
    assert d["compiled"]["R=1 ar"]["same_tokens_as_eager"]
    assert len(d["t_of_n"]["R=8 ms"]) == 16 and d["t_of_n"]["R=1 t16/t1"] > 0
    assert [x["growth_under_the_cache"] for k, x in d["step_bytes"].items() if k != "context"] == [True, True]
    assert st["compiled"]["equal"] and len(st["compiled"]["losses"]["compiled"]) == 3 + 1  # and a shorter batch
    p = st["profile"]
    assert abs(sum(p["shares"].values()) - 1) < 1e-6 and p["shares"]["gemm"] > 0 and p["attention_kernels"]


def test_the_runner_records_a_failed_stage_and_runs_the_rest(tmp_path, monkeypatch):
    # No subprocess: launch is replaced. The file holds every finished stage when the next one starts; a failed
    # stage keeps its error and what it saved; a stage --minutes leaves no room for is skipped.
    out, seen = tmp_path / "gpu.json", []

    def launch(name, s, path, timeout):
        seen.append(name)
        done = json.loads(out.read_text())["stages"] if out.exists() else {}
        assert list(done) == seen[:-1]
        if name == "train":
            time.sleep(1.2)
            return {"status": "failed", "seconds": 0.1, "eager": {"ar": {"ms_per_step": 1.0}}, "error": "planted"}
        return {"status": "ok", "seconds": 0.0, "value": 1.0}

    monkeypatch.setattr(gpu_check, "launch", launch)
    r = gpu_check.main(["--device", "cpu", "--quick", "--stages", "env,train,decode", "--out", str(out)])
    assert json.loads(out.read_text()) == r and seen == ["env", "train", "decode"]
    assert r["stages"]["train"]["error"] == "planted" and r["stages"]["train"]["eager"]["ar"]["ms_per_step"] == 1.0
    assert r["stages"]["decode"] == {"status": "ok", "seconds": 0.0, "value": 1.0}
    seen.clear()
    out = tmp_path / "short.json"
    r = gpu_check.main(["--device", "cpu", "--quick", "--stages", "env,train,decode", "--minutes", "0.1",
                        "--out", str(out)])  # 6 s: after train's 1.2 s, less than the 5 s a stage needs is left
    assert seen == ["env", "train"] and r["stages"]["decode"]["status"] == "skipped"


def test_a_stage_short_of_time_keeps_its_eager_numbers_and_its_tests_output(tmp_path, monkeypatch):
    # compiled: the eager steps are saved before a compile that would not fit; nan: the cuda-marked tests are cut
    # at the stage's time, what they printed kept.
    s = gpu_check.Settings(device="cpu", quick=True)
    r = gpu_check.Record(tmp_path / "c.json", seconds=gpu_stages.COMPILE_S - 1)
    gpu_stages.compiled(s, r)
    saved = json.loads((tmp_path / "c.json").read_text())
    assert len(saved["losses"]["eager"]) == 3 + 1 and saved["eager_ms"] > 0 and "compiled_ms" not in saved
    assert len(r["skipped"]) == 1 and r["skipped"][0].startswith("compiled:") and r["skipped"][0].endswith("s left")

    def run(argv, timeout=None, **kw):  # pytest is there, and its tests run past the time given
        if "import pytest" in argv:
            return subprocess.CompletedProcess(argv, 0)
        raise subprocess.TimeoutExpired(argv, timeout, output=b".....")

    monkeypatch.setattr(gpu_stages, "cuda_test_files", lambda: [])
    monkeypatch.setattr(gpu_stages.subprocess, "run", run)
    assert gpu_stages.cuda_tests(s, 7.0) == {"returncode": None, "summary": "cut at 7 s", "output": "....."}


def test_a_train_py_cut_at_the_stages_time_leaves_its_words_its_rows_and_no_files(tmp_path, monkeypatch):
    # trainpy cuts train.py 10 s before the check would end the stage: the command is saved before it runs,
    # train.py's stderr and the rows it wrote are kept, and the temporary folder goes.
    seen = {}

    def stuck(cmd, stderr=None, timeout=None, **kw):
        out = Path(cmd[cmd.index("--out") + 1])
        seen.update(tmp=out.parent, saved=json.loads((tmp_path / "t.json").read_text()), timeout=timeout)
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "dt": 1.0, "tokens": 8}\n{"step": 2, "lo')
        stderr.write("train.py: stuck in its save\n")
        stderr.flush()
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(gpu_stages.subprocess, "run", stuck)
    r = gpu_check.Record(tmp_path / "t.json", seconds=60)
    with pytest.raises(RuntimeError, match="train.py cut at the stage's time: train.py: stuck in its save"):
        gpu_stages.trainpy(gpu_check.Settings(device="cpu", quick=True), r)
    assert seen["saved"]["command"].startswith("train.py --init TMP/init") and 45 < seen["timeout"] <= 50
    assert r["rows_written"] == [{"step": 1, "loss": 2.5, "dt": 1.0, "tokens": 8}] and not seen["tmp"].exists()


def test_the_nan_stage_names_only_what_failed(tmp_path, monkeypatch):
    # Gradients right, a cuda-marked test failed: the error says that alone, the cases' numbers kept.
    monkeypatch.setattr(gpu_stages, "cuda_tests", lambda s, seconds: {"returncode": 1, "summary": "1 failed"})
    r = gpu_check.Record(tmp_path / "n.json")
    with pytest.raises(RuntimeError) as e:
        gpu_stages.nan(gpu_check.Settings(device="cpu", quick=True), r)
    assert str(e.value) == "cuda-marked tests: 1 failed" and r["ok"] and len(r["cases"]) == 4


def fake_stage(monkeypatch, code: str) -> None:
    monkeypatch.setattr(gpu_check, "stage_command", lambda name, s, out, t: [sys.executable, "-c", code, str(out)])


def test_launch_keeps_what_a_failing_stage_saved_and_its_stderr(tmp_path, monkeypatch):
    fake_stage(monkeypatch, "import sys, json; open(sys.argv[1], 'w').write(json.dumps({'done': 1.5}));"
                            "print('UserWarning: planted', file=sys.stderr); print('\\n'.join(f'line {i}' for i in "
                            "range(40)), file=sys.stderr); sys.exit(3)")
    r = gpu_check.launch("train", gpu_check.Settings(device="cpu"), tmp_path / "t.json", timeout=30)
    assert r["status"] == "failed" and r["done"] == 1.5 and r["warnings"] == ["UserWarning: planted"]
    assert r["error"].splitlines() == ["exit status 3", *(f"line {i}" for i in range(25, 40))]


def test_launch_ends_a_stage_that_hangs_and_the_processes_it_started(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    fake_stage(monkeypatch, "import sys, json, subprocess, time; open(sys.argv[1], 'w').write(json.dumps({'done': 1}));"
                            f"p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid));"
                            "time.sleep(60)")
    t0 = time.monotonic()
    r = gpu_check.launch("decode", gpu_check.Settings(device="cpu"), tmp_path / "d.json", timeout=2)
    assert r["status"] == "timeout" and r["error"].startswith("timed out after 2 s") and r["done"] == 1
    assert time.monotonic() - t0 < 10
    pid = int(pid_file.read_text())
    for _ in range(50):  # the orphaned sleep is gone once init has reaped it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stage's child {pid} outlived its timeout")


def test_a_stage_that_does_not_exist_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--device", "cpu", "--stages", "env,trian"])
    assert e.value.code == 2 and "--stages/--stage trian: no such stage" in capsys.readouterr().err


def test_a_cpu_check_never_writes_over_the_gpus_record(tmp_path, monkeypatch):
    # Without --out, --device cpu --quick writes runs/gpu_check_quick.json: results/gpu.json is a GPU's.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu_check, "launch", lambda name, s, out, timeout: {"status": "ok", "seconds": 0.0})
    gpu_check.main(["--device", "cpu", "--quick", "--stages", "env"])
    assert json.loads((tmp_path / "runs" / "gpu_check_quick.json").read_text())["stages"] == {
        "env": {"status": "ok", "seconds": 0.0}}
    assert not (tmp_path / "results").exists()
    with pytest.raises(SystemExit, match="--out runs is a folder"):
        gpu_check.main(["--device", "cpu", "--quick", "--stages", "env", "--out", "runs"])


def test_gpu_specs_by_name():
    assert gpu_check.gpu_specs("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert gpu_check.gpu_specs("NVIDIA H200") == (989e12, 4.8e12)
    assert gpu_check.gpu_specs("NVIDIA A100-SXM4-80GB") == (312e12, None)
    assert gpu_check.gpu_specs("NVIDIA H100 PCIe") == gpu_check.gpu_specs("NVIDIA L4") == (None, None)
    for name in ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA A100-PCIE-40GB"):
        assert gpu_check.gpu_specs(name) == (None, None), name


def test_profile_kinds_by_kernel_name():
    assert gpu_stages.kind_of("fmha_cutlassB_bf16_aligned_64x64_k64_sm80") == "attention"  # not GEMM: CUTLASS
    assert gpu_stages.kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert gpu_stages.kind_of("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8>") == "loss/softmax"
    assert gpu_stages.kind_of("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert gpu_stages.kind_of("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "other"


def test_gpu_check_collects_only_the_cuda_marked_files():
    # The GPU machine need not have what the other tests import, so only the marked files are collected.
    files = gpu_stages.cuda_test_files()
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
    counted = bench_train.main(["--steps", "1", "--batch-size", "2", "--seq-len", "16"])["modes"]["adapter"]["gflop"]
    assert counted > 0  # the adapter's FLOPs, counted after the timings
    monkeypatch.setattr(bench_train, "linear_gflop", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    r = bench_train.main(["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--json", str(out)])
    assert r["modes"]["adapter"]["gflop"] is None and "out of memory" in r["errors"]["adapter gflop"]
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["modes"]["mars"]["logits_mb"] is None and r["modes"]["ar"]["logits_mb"] == 1.0
    assert r["modes"]["mars"]["fwd_bwd_ms"] > 0 and r["modes"]["mars"]["saved_mb"] > 0
    assert list(r["errors"]) == ["mars logits_mb", "adapter gflop"] and "planted" in r["errors"]["mars logits_mb"]
    modes = r["modes"]
    assert list(modes) == ["ar", "mars", "mars+prune", "1-call", "adapter"]
    assert modes["adapter"]["state_mb"] < modes["mars+prune"]["state_mb"]
    assert modes["mars+prune"]["columns"] < modes["mars"]["columns"] == 2 * modes["ar"]["columns"]
    assert all(any("scaled_dot_product" in k for k in m["sdpa"]) for m in modes.values())  # the backend is named
    table = capsys.readouterr().out
    row = next(line.split() for line in table.splitlines() if line.startswith("mars ") and ":" not in line)
    assert row[11] == "-" and row[12] == f"{r['modes']['mars']['state_mb']:.0f}"  # logits MB, then state MB


def test_the_flop_formula_counts_the_matmuls_torch_counts():
    # bench_train's MFU and GFLOP columns (and the GPU check's) follow matmul_gflop: without its attention term
    # it equals torch's own count of a step's matmuls, chunked cross-entropy's recompute included.
    from tools import bench_train

    s = cli.parse(bench_train.Settings, ["--batch-size", "2", "--seq-len", "32", "--device", "cpu"], "")
    _, _, _, models, _, batches = bench_train.setup(s)
    for name in ("ar", "mars", "mars+prune", "1-call"):
        formula = bench_train.matmul_gflop(models[name].config, batches[name], s, bench_train.MODES[name][2], name,
                                           attention=False)
        assert formula == pytest.approx(bench_train.linear_gflop(models[name], batches[name], name, s), rel=1e-9)


def test_cuda_graph_skips_counts_a_graph_inductor_ran_without_a_cuda_graph():
    # The decode stage's cuda_graph_skips reads inductor's counter: a CUDA graph asked for on the CPU is skipped.
    before = gpu_stages.cuda_graph_skips()
    f = torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert gpu_stages.cuda_graph_skips() == before + 1
