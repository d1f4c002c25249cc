# One command for the day a GPU is at hand (make gpu-check): it runs, on one device, what the CPU
# suite cannot show, and writes results/gpu.json with the device's name:
#   1. the suite's cuda-marked tests (tests/spec/test_device.py: training-loss equality of the split
#      attention and chunked CE, cache exactness) on the device, in float32 and bfloat16;
#   2. tools/bench_train.py at Qwen2.5-0.5B shapes: MARS vs AR step time and memory, and which SDPA
#      backend each mode ran (the profiler's op and kernel names);
#   3. tools/bench.py at Qwen2.5-0.5B shapes (random weights): AR vs MARS decoding speed;
#   4. one MARS decode step (B positions against a 512-token KV cache) under torch.compile vs eager.
# Budget: under 8 minutes on one H200. `--device cpu --quick` runs the same steps at tiny sizes, so
# the script cannot rot (tests/product/test_gpu_check.py runs it).
#   python -m tools.gpu_check                        # on the GPU
#   python -m tools.gpu_check --device cpu --quick   # CI-sized
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcache import KVCache
from mars import cli
from mars.files import write_atomic
from mars.tokenizer import Tokenizer
from model import Transformer
from tools.bench_train import model_config

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Settings:
    device: str = "cuda"  # cuda, cuda:N, or cpu (with --quick: the CI-sized run)
    quick: bool = False  # tiny shapes and one repetition: checks that every step runs, measures nothing
    out: str = "results/gpu.json"  # where the results go (written atomically)
    tests: bool = True  # run the suite's cuda-marked tests on the device first
    compile_backend: str = "auto"  # torch.compile backend; auto: inductor, aot_eager for --quick on cpu


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def cuda_test_files() -> list[str]:
    # Only the files that hold cuda-marked tests: collecting the whole suite would import what the
    # other tests need (openai, lm-eval), which a GPU machine's image need not have.
    return sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.cuda" in f.read_text())


def run_tests(device: torch.device) -> dict:
    # The cuda-marked tests, in a fresh process, on this device.
    t0 = time.perf_counter()
    env = {**os.environ, "MARS_TEST_DEVICE": str(device)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           *cuda_test_files()], cwd=ROOT, env=env, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)}
    print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
    return {"returncode": proc.returncode, "summary": summary, **counts, "seconds": time.perf_counter() - t0}


def tool(module: str, args: list[str], out: Path) -> dict:
    # One of the benchmark tools in a process of its own, its JSON read back: a CUDA error poisons the
    # process that meets it, and only that one, so the steps after it still run.
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args, "--json", str(out)], cwd=ROOT,
                          stdout=None, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    result = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode:
        result["error"] = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {**result, "seconds": time.perf_counter() - t0}


def random_checkpoint(path: Path, config_name: str, device: torch.device, dtype: torch.dtype) -> None:
    # A random model of the benchmark's shapes with the byte-level tokenizer: decoding speed depends
    # on the shapes, not on the weights (the logits past the tokenizer's ids never compete).
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(model_config(config_name))
    model.save_pretrained(path, dtype=dtype)
    Tokenizer.byte_level().save_pretrained(path)


@torch.inference_mode()
def compile_check(ckpt: Path, device: torch.device, dtype: torch.dtype, backend: str, prefix: int,
                  reps: int, B: int = 4) -> dict:
    # One decode step as generate.py runs it: B new positions against a cache of `prefix` committed
    # tokens, explicit mask. Not committing keeps the shapes fixed, so it compiles once.
    model = Transformer.from_pretrained(ckpt, device=device, dtype=dtype).eval()
    c = model.config
    cache = KVCache(c, batch_size=1, max_len=prefix + B, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (1, prefix + B), generator=g).to(device)
    model(x[:, :prefix], cache=cache)
    cache.commit(prefix)
    pos = torch.arange(prefix, prefix + B, device=device)[None]
    mask = (torch.arange(prefix + B, device=device) <= pos[..., None])[:, None]  # (1, 1, B, S)
    args = (x[:, prefix:], pos, mask, cache)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    eager = model(*args).float()
    t0 = time.perf_counter()
    compiled_fn = torch.compile(model, backend=backend)
    compiled = compiled_fn(*args).float()
    sync()
    compile_s = time.perf_counter() - t0
    times = {"eager": [], "compiled": []}
    for _ in range(reps):  # interleaved
        for name, fn in (("eager", model), ("compiled", compiled_fn)):
            sync()
            t = time.perf_counter()
            fn(*args)
            sync()
            times[name].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {"backend": backend, "prefix": prefix, "B": B, "compile_seconds": compile_s,
            "eager_ms": med["eager"], "compiled_ms": med["compiled"], "speedup": med["eager"] / med["compiled"],
            "max_abs_logit_diff": (compiled - eager).abs().max().item(), "logit_scale": eager.abs().max().item()}


def main(argv: list[str] | None = None) -> dict:
    s = cli.parse(Settings, argv, "GPU check: CUDA tests, training and decoding benchmarks, compile.")
    device = torch.device(s.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here. On a CPU machine, run the CI-sized form: "
                         "python -m tools.gpu_check --device cpu --quick")
    t_start = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = s.compile_backend if s.compile_backend != "auto" else (
        "aot_eager" if s.quick and device.type == "cpu" else "inductor")
    config = "small" if s.quick else "qwen2.5-0.5b-shapes"
    result = {"device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "settings": asdict(s), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"gpu check on {result['device']} (torch {torch.__version__})", flush=True)
    path = Path(s.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def stage(key: str, title: str, fn) -> None:
        # One step: its result, or its error, goes into the file at once, so a step that fails or a run
        # that is cut short still leaves every finished step's numbers.
        print(f"\n==== {title} ====", flush=True)
        try:
            result[key] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, and the remaining steps still run
            import traceback

            traceback.print_exc()
            result[key] = {"error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.perf_counter() - t_start
        write_atomic(path, json.dumps(result, indent=1) + "\n")

    if s.tests:
        stage("tests", "1. cuda-marked tests on the device", lambda: run_tests(device))

    size = ["--batch-size", "2", "--seq-len", "32", "--steps", "1"] if s.quick else \
        ["--batch-size", "8", "--seq-len", "512", "--steps", "5"]
    with tempfile.TemporaryDirectory() as tmp:
        stage("bench_train", f"2. training step, MARS vs AR ({config})",
              lambda: tool("tools.bench_train", ["--config", config, "--device", s.device, "--prompt-frac", "0.4",
                                                 *size], Path(tmp) / "bench_train.json"))
        ckpt = Path(tmp) / "random"
        random_checkpoint(ckpt, config, torch.device("cpu"), dtype)
        size = ["--batch-sizes", "1", "2", "--max-new-tokens", "8", "--reps", "1"] if s.quick else \
            ["--batch-sizes", "1", "8", "--max-new-tokens", "128", "--reps", "3"]
        stage("bench", f"3. decoding speed, MARS vs AR ({config}, random weights)",
              lambda: tool("tools.bench", ["--ckpt", str(ckpt), "--device", s.device, "--no-hf", "--thresholds",
                                           "0.9", *size], Path(tmp) / "bench.json"))

        def compiled() -> dict:
            r = compile_check(ckpt, device, dtype, backend, prefix=16 if s.quick else 512, reps=2 if s.quick else 20)
            print(json.dumps(r, indent=1), flush=True)
            return r

        stage("compile", f"4. decode step: torch.compile ({backend}) vs eager", compiled)

    print(f"\nwrote {path} in {result['seconds']:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
