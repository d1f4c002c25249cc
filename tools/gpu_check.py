# One command for the day a GPU is at hand (make gpu-check): what the CPU suite cannot show, in stages ordered by
# value, each in a process of its own with a timeout of its own, so that a CUDA error (which poisons the process
# that meets it) or a hang costs only its stage. The JSON at --out names the device and the torch, CUDA and cuDNN
# versions, then each stage's numbers, status (ok, failed, timeout, skipped) and, when it failed, the last lines of
# its stderr; it is rewritten after every stage, and a stage saves its numbers as it goes, so a run cut short keeps
# what finished. The stages, in order (tools/gpu_stages.py):
#   env       versions, SDPA's backend priority, the kernel each of model.attend's calls picks
#   nan       pytorch/pytorch#196678's case (bf16 masked attention at 832 and 896 keys), the cuda-marked tests
#   train     AR and MARS training steps at Qwen2.5-0.5B shapes (16 x 512, bf16, fused AdamW), eager and compiled
#   bisect    the first GPU run's fault: plain step, dispatch-mode probe, saved-tensor probe, profiler, plain step
#   trainpy   train.py itself on a random checkpoint of those shapes: steps, evals and a save, all finite
#   decode    AR, threshold 0.9 and verify at batch 1 and 8, eager and compiled (with the compiled graphs that run
#             without a CUDA graph); t(n); the HBM roofline; the bytes a step allocates after a short and a long cache
#   compiled  the training step compiled against eager: time and losses on the same weights
#   profile   kernel-time shares of a MARS step (last: a profiler's teardown is a suspect of that fault)
# The timeouts sum to under 9 minutes (one H100 or H200), and --minutes caps the whole. It runs with the machine's
# own torch. `--device cpu --quick` runs every stage at tiny shapes (tests/product/test_gpu_check.py).
#   python -m tools.gpu_check                                 # on the GPU: results/gpu.json
#   python -m tools.gpu_check --stages env,nan --out /tmp/gpu.json
#   python -m tools.gpu_check --device cpu --quick --out /tmp/gpu.json
from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mars import cli
from mars.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]
TIMEOUTS = {"env": 25, "nan": 55, "train": 130, "bisect": 30, "trainpy": 90, "decode": 105, "compiled": 75,
            "profile": 25}  # seconds per stage on the GPU: 535 in all
QUICK_TIMEOUT = 180  # per stage under --quick, where a loaded CI machine sets the pace
STAGE_ENV = {"bisect": {"CUDA_LAUNCH_BLOCKING": "1"}}  # so that a failing kernel fails in the op that ran it
TAIL = 15  # stderr lines kept for a stage that failed


@dataclass
class Settings:
    device: str = "cuda"  # cuda, cuda:N, or cpu (with --quick: the CI-sized run)
    quick: bool = False  # tiny shapes and few repetitions: checks that every stage runs, measures nothing
    out: str = ""  # the check's JSON, rewritten after each stage (default: results/gpu.json on a GPU, and
    # runs/gpu_check_quick.json for --quick or --device cpu, which never writes over a GPU's record); with --stage,
    # that stage's JSON
    stages: str = ",".join(TIMEOUTS)  # the stages to run, comma-separated, each in its own process
    minutes: float = 9.0  # the whole check's limit: a stage gets its timeout or what is left, whichever is less
    compile_backend: str = "auto"  # torch.compile's backend; auto: inductor, aot_eager for --quick on the CPU
    stage: str = ""  # run this one stage here and write its JSON to --out (what each of the check's processes runs)
    stage_timeout: float = 0.0  # with --stage: its timeout, so that it skips a compile that would not fit; 0 = none


def check_settings(s: Settings) -> None:
    unknown = [n for n in s.stages.split(",") + ([s.stage] if s.stage else []) if n not in TIMEOUTS]
    if unknown:
        raise ValueError(f"--stages/--stage {','.join(unknown)}: no such stage; choose from {','.join(TIMEOUTS)}")
    if not s.minutes > 0:
        raise ValueError(f"--minutes {s.minutes} must be > 0")


# What the tables below know of a GPU, by its name: peak dense bf16 FLOP/s (for MFU) and HBM bytes/s (for the
# decode roofline). None: not in the table (unknown).
GPUS = {"H200": (989e12, 4.8e12), "H100 SXM": (989e12, 3.35e12), "A100": (312e12, None)}


def gpu_specs(name: str) -> tuple[float | None, float | None]:
    # A MIG slice has a part of the chip's peaks; PCIe and NVL cards, and an H100 named neither SXM nor HBM3,
    # have other peaks than the table's; a GH200 is not an H200.
    if any(w in name.upper() for w in ("MIG", "NVL", "PCIE")):
        return None, None
    if "H100" in name and not any(w in name for w in ("SXM", "HBM3")):
        return None, None
    key = next((k for k in GPUS if re.search(rf"\b{k.split()[0]}\b", name)), None)
    return GPUS[key] if key else (None, None)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def backend(s: Settings) -> str:
    if s.compile_backend != "auto":
        return s.compile_backend
    return "aot_eager" if s.quick and torch.device(s.device).type == "cpu" else "inductor"


# ---- one stage, in the process that runs it ----

class Record(dict):
    # One stage's results, written to its file (atomically) at each save(): a stage cut short keeps what it saved.
    # seconds: the stage's time before the check ends it (0: unlimited), which left() counts down.
    def __init__(self, path: Path, seconds: float = 0.0):
        super().__init__()
        self.path, self.deadline = path, time.monotonic() + seconds if seconds else math.inf

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self, indent=1) + "\n")


def run_stage(s: Settings) -> None:
    from tools import gpu_stages

    r = Record(Path(s.out), max(1.0, s.stage_timeout - 5) if s.stage_timeout else 0.0)  # 5 s: this process's start
    try:
        gpu_stages.STAGES[s.stage](s, r)
    finally:
        r.save()


# ---- the check: each stage in a process of its own ----

def stage_command(name: str, s: Settings, out: Path, timeout: float) -> list[str]:
    return [sys.executable, "-m", "tools.gpu_check", "--stage", name, "--device", s.device, "--out", str(out),
            "--compile-backend", s.compile_backend, "--stage-timeout", f"{timeout:.0f}",
            *(["--quick"] if s.quick else [])]


def launch(name: str, s: Settings, out: Path, timeout: float) -> dict:
    # -> the stage's JSON with its status and seconds; when it failed or timed out, the last lines of its stderr.
    # Its own session, so that a timeout, and any process it left behind, ends its children too (train.py,
    # compile workers), and the next stage starts on a GPU that nothing else holds.
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(stage_command(name, s, out, timeout), cwd=ROOT, stderr=err, start_new_session=True,
                                env={**os.environ, **STAGE_ENV.get(name, {})})
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended, and left nothing behind
                pass
            proc.wait()
        err.seek(0)
        lines = [line for line in err.read().splitlines() if line.strip()]
    record = {"status": status, "seconds": round(time.monotonic() - t0, 2)}
    try:
        record |= {k: v for k, v in (json.loads(out.read_text()) if out.exists() else {}).items() if k not in record}
    except json.JSONDecodeError as e:
        record["json_error"] = str(e)
    warnings = list(dict.fromkeys(line.strip() for line in lines if "Warning:" in line))
    if warnings:
        record["warnings"] = warnings[:10]
    if status != "ok":
        why = f"timed out after {timeout:.0f} s" if status == "timeout" else f"exit status {proc.returncode}"
        record["error"] = "\n".join([why, *lines[-TAIL:]])
        print(record["error"], file=sys.stderr, flush=True)
    return record


def main(argv: list[str] | None = None) -> dict | None:
    s = cli.parse(Settings, argv, "GPU check: every stage in a process of its own; JSON after each.",
                  check=check_settings)
    if s.stage:
        return run_stage(s)
    try:
        device = torch.device(s.device)
    except RuntimeError:
        raise SystemExit(f"error: --device {s.device}: choose cuda, cuda:N or cpu") from None
    if not s.out:
        s = replace(s, out="runs/gpu_check_quick.json" if s.quick or device.type == "cpu" else "results/gpu.json")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device here; on a CPU machine run the CI-sized form: "
                         "python -m tools.gpu_check --device cpu --quick --out /tmp/gpu.json")
    t0 = time.monotonic()
    flops, hbm = gpu_specs(device_name(device))
    report = {"device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
              "peak_bf16_flops": flops or "unknown", "hbm_bytes_per_s": hbm or "unknown",
              "settings": asdict(s), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}}
    print(f"gpu check on {report['device']} (torch {torch.__version__}, CUDA {torch.version.cuda}) -> {s.out}",
          flush=True)
    path = Path(s.out)
    if path.is_dir():  # found before any stage runs, not after the first
        raise SystemExit(f"error: --out {path} is a folder; give a file name in it, such as {path / 'gpu.json'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    names = s.stages.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names, 1):
            timeout = min(QUICK_TIMEOUT if s.quick else TIMEOUTS[name], s.minutes * 60 - (time.monotonic() - t0))
            print(f"\n==== {i}/{len(names)} {name} (timeout {timeout:.0f} s) ====", flush=True)
            if timeout < 5:
                record = {"status": "skipped", "error": f"--minutes {s.minutes:g} ran out before this stage"}
            else:
                record = launch(name, s, Path(tmp) / f"{name}.json", timeout)
            report["stages"][name] = record
            report["seconds"] = round(time.monotonic() - t0, 1)
            write_atomic(path, json.dumps(report, indent=1) + "\n")
            print(f"---- {name}: {record['status']} ({record.get('seconds', 0):.1f} s)", flush=True)
    print(f"\nwrote {path} in {report['seconds']:.0f} s: " +
          ", ".join(f"{n} {r['status']}" for n, r in report["stages"].items()), flush=True)
    return report


if __name__ == "__main__":
    main()
