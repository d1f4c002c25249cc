# The stages of tools/gpu_check.py, each run in a process of its own: stage(s, r) fills r (a gpu_check.Record) and
# saves it as it goes. Shapes: Qwen2.5-0.5B's (random weights; time and memory depend on the shapes), or under
# --quick a 2-layer model of width 64 at a few tokens (config). On CUDA the compute is bf16 (autocast over float32
# master weights for training, as train.py; bf16 weights for decoding); on the CPU, float32.
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from generate import Options, decode
from mars import budget, cli
from mars.tokenizer import Tokenizer
from model import Config, Transformer, attend, attention_backends
from tools import bench_train, forward_cost
from tools.bench_train import MODES, loss_of, matmul_gflop, mode_batch, model_config
from tools.gpu_check import ROOT, Record, Settings, backend, device_name, gpu_specs
from train import compile_blocks

COMPILE_S = 45  # what a compile is taken to need: one that would not fit in the stage's time is skipped, not cut


def shapes(s: Settings) -> str:
    return "tiny" if s.quick else "qwen2.5-0.5b-shapes"


def config(s: Settings) -> Config:
    # --quick: bench_train's small config cut to 2 layers of width 64 (still the byte-level tokenizer's 260 ids)
    if s.quick:
        return replace(model_config("small"), hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    return model_config("qwen2.5-0.5b-shapes")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_for(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def trainer(s: Settings, B: int, T: int, names: tuple[str, ...], layers: int = 0):
    # A random model of the stage's shapes (float32 master weights, as train.py), fused AdamW on CUDA, and one
    # batch per bench_train mode in names: B rows of T tokens, ~40% prompt. layers: fewer layers (0: all).
    device = torch.device(s.device)
    cli.keep_freed_memory(device)
    bs = bench_train.Settings(batch_size=B, seq_len=T, prompt_frac=0.4, device=s.device)
    c = replace(config(s), num_hidden_layers=layers or config(s).num_hidden_layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(c)
    batches = {n: mode_batch(bs, c.vocab_size, n, device) for n in names}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return bs, model, opt, batches


def step(model, opt, batch, name: str, bs, device: torch.device) -> tuple[float, float]:
    # One optimizer step on the batch: -> (seconds, loss).
    sync(device)
    t0 = time.perf_counter()
    with autocast_for(device):
        loss = loss_of(model, batch, name, bs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t0, loss.item()


def finite(xs) -> bool:
    return all(x == x and abs(x) != float("inf") for x in xs)


# ---- 1. env ----

def sdpa_enabled() -> list[str]:
    b = torch.backends.cuda
    return [n for n, on in (("flash", b.flash_sdp_enabled()), ("efficient", b.mem_efficient_sdp_enabled()),
                            ("cudnn", b.cudnn_sdp_enabled()), ("math", b.math_sdp_enabled())) if on]


class AttendCalls(TorchFunctionMode):
    # Every SDPA call under it, with the backend SDPA picks for it: torch._fused_sdp_choice on the call's own
    # arguments (cast as autocast casts them), under the backends enabled at the call (attend's sdpa_kernel).
    def __init__(self):
        super().__init__()
        self.site, self.calls = "", {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, mask = args[0], args[1], kwargs.get("attn_mask")
            kind = q.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else q.dtype
            try:
                picked = SDPBackend(int(torch._fused_sdp_choice(*(x.to(dtype) for x in args[:3]), **kwargs))).name
            except (RuntimeError, TypeError, ValueError) as e:
                picked = f"unknown ({type(e).__name__}: {e})"[:200]
            where = "causal" if mask is None else f"mask {list(mask.shape)}"
            self.calls[f"{self.site}: q {list(q.shape)} k {list(k.shape)} {where}"] = {
                "picked": picked, "enabled": sdpa_enabled(), "dtype": str(dtype).removeprefix("torch.")}
        return func(*args, **kwargs)


def env(s: Settings, r: Record) -> None:
    device = torch.device(s.device)
    priority = getattr(torch._C, "_get_sdp_priority_order", lambda: [])()
    r.update(device=device_name(device), torch=torch.__version__, cuda=torch.version.cuda,
             python=sys.version.split()[0], cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
             sdpa_priority=[SDPBackend(int(i)).name for i in priority], sdpa_enabled=sdpa_enabled(),
             attention=attention_backends(device))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        r.update(capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                 peak_bf16_flops=gpu_specs(p.name)[0], hbm_bytes_per_s=gpu_specs(p.name)[1])
    r.save()
    # attend's calls as training and decoding make them: one layer of the real heads, the real lengths
    B, T, context = (2, 32, 32) if s.quick else (2, 512, 512)
    bs, model, _, batches = trainer(s, B, T, ("ar", "mars+prune"), layers=1)
    probe = AttendCalls()
    with probe:
        for name, batch in batches.items():
            probe.site = f"train {name}"
            with autocast_for(device):
                loss = loss_of(model, batch, name, bs)
            loss.backward()
        model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        for R in (1, 8):
            probe.site = f"decode R={R} (n=1, 16)"
            budget.measure(model, R, [1, 16], context=context, reps=1)
    r["attend_calls"] = probe.calls


# ---- 2. nan: pytorch/pytorch#196678 ----

def compare(grads: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> dict:
    ok_finite = all(bool(torch.isfinite(g).all()) for g in grads)
    diff = max(((g.float().cpu() - f).abs().max() / max(1.0, f.abs().max())).item() for g, f in zip(grads, ref))
    return {"finite": ok_finite, "max_rel_diff": diff if ok_finite else None, "ok": ok_finite and diff <= tol}


def attention_grads(fn, q, k, v, mask, weight, device) -> list[torch.Tensor]:
    qd, kd, vd = (x.to(device).clone().requires_grad_() for x in (q, k, v))
    (fn(qd, kd, vd, mask.to(device)).float() * weight.to(device)).sum().backward()
    return [qd.grad, kd.grad, vd.grad]


def cuda_test_files() -> list[str]:
    # Only the files that hold cuda-marked tests: collecting the whole suite would import what the other tests
    # need (openai, lm-eval), which a GPU machine's image need not have.
    return sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.cuda" in f.read_text())


def cuda_tests(s: Settings, seconds: float | None = None) -> dict:
    # The suite's cuda-marked tests on this device, in a process of their own (--quick: one NaN case), cut at
    # `seconds` (None: no limit), when what they printed so far is kept.
    if subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True).returncode:
        return {"skipped": "pytest is not installed"}
    only = ["-k", "cudnn_gave_nan and 64-832"] if s.quick else []
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *only,
                               *cuda_test_files()], cwd=ROOT, env={**os.environ, "MARS_TEST_DEVICE": s.device},
                              capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as e:
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return {"returncode": None, "summary": f"cut at {seconds:.0f} s", "output": said[-2000:]}
    lines = proc.stdout.strip().splitlines() or [""]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", lines[-1])}
    return {"returncode": proc.returncode, "summary": lines[-1], **counts,
            **({"output": "\n".join(lines[-30:]) + proc.stderr[-2000:]} if proc.returncode else {})}


def cudnn_alone(q, k, v, mask):
    # SDPA's cuDNN kernel, k and v expanded to every head: whether this torch still has the bug (attend never
    # runs it with a mask).
    G = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)


def nan(s: Settings, r: Record) -> None:
    from tests.spec.cudnn_nan import LSE_BOUND, math_reference, nan_case

    device = torch.device(s.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    r.update(dtype=str(dtype).removeprefix("torch."), tolerance=tol, cases={})
    paths = {"attend": lambda q, k, v, m: attend(q, k, v, m)}
    if device.type == "cpu":  # CUDA's path (no cuDNN) runs on the CPU too
        paths["attend, CUDA's path"] = lambda q, k, v, m: attend(q, k, v, m, cuda=True)
    cases = {}
    for S in (832, 896):
        for T in (64, 256):
            case = cases[f"S={S} T={T}"] = nan_case(S, T, dtype)
            ref, lse = math_reference(*case)
            row = r["cases"][f"S={S} T={T}"] = {"lse": lse, "condition": lse < LSE_BOUND}
            for name, fn in paths.items():
                row[name] = compare(attention_grads(fn, *case, device), ref, tol)
            cases[f"S={S} T={T}"] = (case, ref)
            r.save()
    bad = [f"{c} {p}" for c, row in r["cases"].items() for p in paths if not row[p]["ok"]]
    r["ok"] = not bad and all(row["condition"] for row in r["cases"].values())
    r.save()
    left = r.left()  # 10 s of it kept for cuDNN's own cases below
    r["cuda_tests"] = cuda_tests(s, max(5.0, left - 10) if math.isfinite(left) else None)
    r.save()
    for key, (case, ref) in cases.items():  # last: a kernel that fails here must not take the numbers above with it
        try:
            r["cases"][key]["cudnn alone"] = compare(attention_grads(cudnn_alone, *case, device), ref, tol)
        except RuntimeError as e:  # no cuDNN (the CPU), or cuDNN refuses the mask
            r["cases"][key]["cudnn alone"] = {"error": str(e).strip().splitlines()[0][:300]}
        r.save()
    problems = [f"masked attention gradients wrong in {', '.join(bad)}"] if bad else []
    if r["cuda_tests"].get("returncode", 0) != 0:  # failed, or cut at the stage's time (None)
        problems.append(f"cuda-marked tests: {r['cuda_tests']['summary']}")
    if problems:
        raise RuntimeError("; ".join(problems))


# ---- 3. train ----

def train(s: Settings, r: Record) -> None:
    device = torch.device(s.device)
    B, T, reps = (2, 32, 2) if s.quick else (16, 512, 5)
    flops = gpu_specs(device_name(device))[0]
    r.update(batch=B, seq_len=T, shapes=shapes(s), backend=backend(s), peak_bf16_flops=flops or "unknown")
    bs, model, opt, batches = trainer(s, B, T, ("ar", "mars+prune"))
    for kind in ("eager", "compiled"):
        if kind == "compiled":  # as train.py --compile
            compile_blocks(model, backend(s))
        for name, batch in batches.items():
            if kind == "compiled" and r.left() < COMPILE_S:
                r.setdefault("skipped", []).append(f"{kind} {name}: {r.left():.0f} s left")
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            first, loss = step(model, opt, batch, name, bs, device)  # the warm-up (the compiled pass: compiles)
            times, losses = zip(*[step(model, opt, batch, name, bs, device) for _ in range(reps)])
            sec = statistics.median(times)
            gflop = matmul_gflop(model.config, batch, bs, MODES[name][2], name)  # 6N per column + attention + head
            r.setdefault(kind, {})[name] = {
                "ms_per_step": 1e3 * sec, "tokens_per_s": B * T / sec, "tflop_per_s": gflop / sec / 1e3,
                "mfu": gflop * 1e9 / sec / flops if flops else None, "first_step_s": first,
                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                "losses": [loss, *losses], "finite": finite([loss, *losses])}
            r.save()
            if not r[kind][name]["finite"]:
                raise RuntimeError(f"{kind} {name}: loss not finite: {[loss, *losses]}")


# ---- 4. bisect: the fault of the first GPU run ----

def bisect(s: Settings, r: Record) -> None:
    # That run's probes ran per mode (ar: saved, logits, profiler; then mars), so every probe after the AR profiler
    # ran after a profiler session. Here each phase runs for both modes before the next, under CUDA_LAUNCH_BLOCKING=1
    # (gpu_check.STAGE_ENV): the first phase that fails names the culprit, and the process stops there.
    device = torch.device(s.device)
    B, T = (2, 32) if s.quick else (8, 512)  # that run's batch
    bs, model, opt, batches = trainer(s, B, T, ("ar", "mars"))
    auto = autocast_for(device)
    phases = {
        "plain step ms": lambda n, b: 1e3 * step(model, opt, b, n, bs, device)[0],
        "dispatch-mode probe (logits MB)": lambda n, b: bench_train.logits_mb(model, b, n, bs, auto),
        "saved-tensor probe (saved MB)": lambda n, b: bench_train.saved_mb(model, b, n, bs, auto),
        "profiler (attention ops)": lambda n, b: bench_train.sdpa_kernels(model, b, n, bs, auto, device),
        "plain step after the profiler ms": lambda n, b: 1e3 * step(model, opt, b, n, bs, device)[0]}
    r.update(batch=B, seq_len=T, cuda_launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING", ""), phases={},
             first_failure=None)
    for phase, probe in phases.items():
        for name, batch in batches.items():
            try:
                r["phases"][f"{phase}: {name}"] = probe(name, batch)
                sync(device)
            except Exception as e:
                r["phases"][f"{phase}: {name}"] = f"{type(e).__name__}: {e}"[:2000]
                r["first_failure"] = f"{phase}: {name}"
                r.save()
                raise
            r.save()


# ---- 5. trainpy: train.py itself ----

def chats(path: Path, n: int, chars: int, seed: int) -> None:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                        for _ in range(k // 5))[:k]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text(chars // 4)},
                                                     {"role": "assistant", "content": text(chars)}]}) + "\n"
                            for _ in range(n)))


def trainpy(s: Settings, r: Record) -> None:
    # A random checkpoint of the stage's shapes with the byte-level tokenizer, random chats, then train.py as a
    # user runs it: 4 steps, evals at steps 0, 2 and 4, the last step's checkpoint and the final model (at these
    # shapes a step checkpoint holds about 7 GB: the float32 weights and AdamW's two moments).
    B, T, chars = (4, 64, 40) if s.quick else (8, 512, 400)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        Transformer(config(s)).save_pretrained(tmp / "init", dtype=torch.bfloat16)
        Tokenizer.byte_level().save_pretrained(tmp / "init")
        chats(tmp / "train.jsonl", 4 * B, chars, 0)
        chats(tmp / "eval.jsonl", B, chars, 1)
        out = tmp / "run"
        cmd = [sys.executable, "train.py", "--init", str(tmp / "init"), "--data", str(tmp / "train.jsonl"),
               "--eval-data", str(tmp / "eval.jsonl"), "--mode", "mars", "--max-steps", "4", "--eval-every", "2",
               "--save-every", "4", "--batch-size", str(B), "--global-batch", str(B), "--max-len", str(T),
               "--device", s.device, "--out", str(out), "--quiet"]
        r.update(command=" ".join(cmd[1:]).replace(str(tmp), "TMP"))
        r.save()
        t0 = time.monotonic()
        # Cut here, 10 s before the check would end this stage: what train.py said and the rows it wrote are
        # kept, and the temporary folder (gigabytes at these shapes) goes.
        with open(tmp / "stderr.txt", "w+") as err:
            try:
                proc = subprocess.run(cmd, cwd=ROOT, stderr=err, text=True, timeout=max(5.0, r.left() - 10))
            except subprocess.TimeoutExpired:
                proc = None
            r["train_py_seconds"] = time.monotonic() - t0
            err.seek(0)
            said = err.read().strip()[-3000:]
        rows = []  # a run cut short may have left its last line half written
        for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").is_file() else []:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        if proc is None or proc.returncode:
            r.update(rows_written=rows)
            cause = "cut at the stage's time" if proc is None else f"exit status {proc.returncode}"
            raise RuntimeError(f"train.py {cause}: {said}")
        steps, evals = [x for x in rows if "loss" in x], [x for x in rows if "eval_loss" in x]
        numbers = [v for x in rows for v in x.values() if isinstance(v, float)]
        r.update(steps=len(steps), evals=len(evals), losses=[x["loss"] for x in steps],
                 eval_losses=[x["eval_loss"] for x in evals], step_seconds=[x["dt"] for x in steps],
                 tokens_per_s=[x["tokens"] / x["dt"] for x in steps], finite=finite(numbers),
                 saved=sorted(p.name for p in out.iterdir()),
                 checkpoints=sorted(p.name for p in (out / "checkpoints").iterdir()))
    if not r["finite"] or len(steps) != 4 or len(evals) != 3 or "model.safetensors" not in r["saved"] \
            or not r["checkpoints"]:
        raise RuntimeError("train.py: a metric is not finite, or a step, an eval or the saved model is missing")


# ---- 6. decode ----

METHODS = {"ar": dict(tau=1.0), "threshold 0.9": dict(tau=0.9), "verify": dict(verify=True)}


def timed_decode(model, prompts, mask_id: int, opts: Options, reps: int, device: torch.device):
    # -> (seconds of the first run, which warms up and compiles; the median seconds of reps more; their tokens
    # and forwards). No stop tokens: every row decodes opts.max_new_tokens.
    times = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        out, forwards = decode(model, prompts, mask_id, set(), opts)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:]), out, forwards


def host_waits(device: torch.device, fn) -> int | None:
    # How often fn makes the host wait for the GPU (a copy to the host, a blocking copy to the device), as
    # torch.cuda.set_sync_debug_mode reports it; None off CUDA.
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def cuda_graph_skips() -> int:
    # How many compiled graphs inductor has run in this process without a CUDA graph (mutated inputs that are not
    # static, a CPU op, ...): the warning that says why is shown only under TORCH_LOGS=cudagraphs.
    return counters["inductor"]["cudagraph_skips"]


def decode_stage(s: Settings, r: Record) -> None:
    # Random weights: a threshold row accepts about one token a step, so the rows time the step, not MARS's
    # gain. ms per forward: a run's seconds over its forwards, the prompt's included.
    device = torch.device(s.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt, new, context, reps = (16, 8, 32, 1) if s.quick else (128, 32, 512, 3)
    c = config(s)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(c).to(dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    hbm = gpu_specs(device_name(device))[1]
    t_min = weights / hbm if hbm else None  # a forward reads every weight once: its least time on this GPU
    r.update(shapes=shapes(s), dtype=str(dtype).removeprefix("torch."), prompt=prompt, new_tokens=new,
             weight_bytes=weights, hbm_bytes_per_s=hbm or "unknown", roofline_ms_per_forward=t_min and 1e3 * t_min)
    runs = [(method, R) for method in METHODS for R in (1, 8)]  # by value: a compile a run, the later may time out
    eager, need = {}, COMPILE_S
    for kind in ("eager", "compiled"):
        if kind == "compiled":
            r["compile_backend"] = backend(s)
            if backend(s) != "inductor":  # mars/compiled.py's step under another backend, through its hook
                from mars import compiled as static

                static.COMPILED[model] = torch.compile(static.step, dynamic=False, backend=backend(s))
        for method, R in runs:
            if kind == "compiled" and s.quick and (method, R) != ("ar", 1):
                continue  # the CI-sized run checks that it runs: one compile
            if kind == "compiled" and r.left() < need:  # each run compiles its own shapes
                r.setdefault("skipped", []).append(f"{kind} R={R} {method}: {r.left():.0f} s left")
                continue
            prompts = torch.randint(0, min(1000, c.vocab_size - 8), (R, prompt),
                                    generator=torch.Generator().manual_seed(R)).tolist()
            extra = {"compile": True} if kind == "compiled" else {}
            opts = Options(B=4, max_new_tokens=new, **METHODS[method], **extra)
            skips = cuda_graph_skips()
            first, sec, out, forwards = timed_decode(model, prompts, c.vocab_size - 1, opts, reps, device)
            per_forward = statistics.mean(len(o) / f for o, f in zip(out, forwards))
            waits = host_waits(device, partial(decode, model, prompts, c.vocab_size - 1, set(), opts))
            row = r.setdefault(kind, {})[f"R={R} {method}"] = {
                "tokens_per_s": sum(map(len, out)) / sec, "ms_per_forward": 1e3 * sec / max(forwards),
                "tokens_per_forward": per_forward, "first_run_s": first,
                "roofline_tokens_per_s": R * per_forward / t_min if t_min else None,
                "host_waits_per_forward": waits and waits / max(forwards)}  # one is the rule's read
            if kind == "eager":
                eager[method, R] = out
            else:
                row["same_tokens_as_eager"], need = out == eager[method, R], max(10.0, 1.2 * first)
                if device.type == "cuda":  # compiled graphs inductor ran without a CUDA graph; 0: all were captured
                    row["cuda_graph_skips"] = cuda_graph_skips() - skips
            r.save()
        if kind == "eager":  # t(n): one forward feeding n positions per row over `context` cached ones
            r["t_of_n"] = {"context": context, "n": list(range(1, 17))}
            for R in (1, 8):
                t = budget.measure(model, R, list(range(1, 17)), context=context, reps=reps)
                r["t_of_n"][f"R={R} ms"] = [1e3 * x for x in t]
                r["t_of_n"][f"R={R} t16/t1"] = t[-1] / t[0]
            r["step_bytes"] = step_bytes(model, (context, 4 * context))
            r.save()


def step_bytes(model: Transformer, contexts: tuple[int, int]) -> dict:
    # What one eager decode step allocates (tools/forward_cost.py; SDPA's own scratch unseen) after a short and a
    # long cache. With the cache read as stored it follows the positions fed, not the cache: the growth stays
    # under the bytes of the cache's added columns, which a copy of the cache every step would allocate at least.
    c, size = model.config, model.model.embed_tokens.weight.element_size()
    out = {"context": list(contexts)}
    for R, n in ((1, 1), (8, 16)):
        near, far = (forward_cost.step_bytes(model, R, n, k).bytes for k in contexts)
        cache = 2 * c.num_hidden_layers * R * c.num_key_value_heads * (contexts[1] - contexts[0]) * c.head_dim * size
        out[f"R={R} n={n}"] = {"bytes": [near, far], "growth_under_the_cache": far - near < cache}
    return out


# ---- 7. compiled against eager ----

def compiled(s: Settings, r: Record) -> None:
    # Two copies of the same weights, one with each block compiled (as train.py --compile), the same batches:
    # the losses of 4 steps of each (the first on identical weights) and of one more on a batch a quarter shorter,
    # as a run's micro-batches differ in length (its noisy queries stay past attend's few-query branch, so the
    # graph takes it without a second compile); the step times after the first. The eager steps run first and are
    # saved: a compile that would not fit in the stage's time is skipped.
    device = torch.device(s.device)
    B, T, steps = (2, 32, 3) if s.quick else (4, 512, 4)
    name = "mars+prune"
    bs, model, opt, batches = trainer(s, B, T, (name,))
    shorter = replace(bs, seq_len=3 * T // 4)
    short = mode_batch(shorter, model.config.vocab_size, name, device)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-5, fused=device.type == "cuda")
    compile_blocks(twin, backend(s))
    tol = 2e-2 if device.type == "cuda" else 1e-4
    r.update(batch=B, seq_len=T, mode=name, backend=backend(s), tolerance=tol)

    def run(m, o) -> tuple[list[float], float, list[tuple[float, float]]]:  # -> losses, ms after the first, steps
        runs = [step(m, o, batches[name], name, bs, device) for _ in range(steps)]
        runs.append(step(m, o, short, name, shorter, device))  # the graph's second shape
        return [x[1] for x in runs], 1e3 * statistics.median(x[0] for x in runs[1:steps]), runs

    losses = r["losses"] = {}
    losses["eager"], r["eager_ms"], _ = run(model, opt)
    r.save()  # kept if the compile below does not finish in the stage's time
    if r.left() < COMPILE_S:
        r.setdefault("skipped", []).append(f"compiled: {r.left():.0f} s left")
        return
    losses["compiled"], r["compiled_ms"], runs = run(twin, twin_opt)
    r["compile_s"] = runs[0][0]
    diff = [abs(a - b) / max(1.0, abs(a)) for a, b in zip(losses["eager"], losses["compiled"])]
    r.update(speedup=r["eager_ms"] / r["compiled_ms"], max_rel_loss_diff=max(diff), equal=max(diff) <= tol,
             finite=finite(losses["eager"] + losses["compiled"]))
    if not (r["equal"] and r["finite"]):  # the stage fails, its numbers kept
        raise RuntimeError(f"compiled losses {losses['compiled']} against eager {losses['eager']}: "
                           f"relative difference {max(diff):.2e} (tolerance {tol}), finite {r['finite']}")


# ---- 8. profile ----

# Kernel (CUDA) or op (CPU) name patterns, the first match wins: an attention kernel built on CUTLASS is attention.
# elementwise takes the reductions and copies too; other: AdamW's multi-tensor kernels, embedding, memcpy.
KINDS = {
    "attention": ("flash", "fmha", "attention", "sdpa", "scaled_dot_product"),
    "loss/softmax": ("softmax", "cross_entropy", "nll_loss", "logsumexp"),
    "gemm": ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
             "splitk"),
    "elementwise": ("elementwise", "vectorized", "unrolled", "reduce", "triton_", "copy", "cat", "aten::add",
                    "aten::mul", "aten::sub", "aten::div", "aten::silu", "aten::rsqrt", "aten::pow", "aten::mean",
                    "aten::neg", "aten::where", "aten::fill", "aten::sum", "aten::exp", "aten::masked_fill"),
}


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, words in KINDS.items() if any(w in low for w in words)), "other")


def profile(s: Settings, r: Record) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    # 8 x 512, not the train stage's 16: the last stage gets what the others left of the check's minutes, and
    # the kernels' shares hardly move with the batch.
    device = torch.device(s.device)
    B, T = (2, 32) if s.quick else (8, 512)
    name = "mars+prune"
    r.update(batch=B, seq_len=T, mode=name)
    r.save()
    bs, model, opt, batches = trainer(s, B, T, (name,))
    step(model, opt, batches[name], name, bs, device)  # the warm-up
    r.update(warmed_up=True)
    r.save()
    cuda = device.type == "cuda"
    with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step(model, opt, batches[name], name, bs, device)
    # Self times: each kernel's on CUDA, each op's own on the CPU, so nothing is counted twice.
    us = {}
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False):  # a record_function's span (AdamW's step): its kernels count
            continue
        if cuda and e.device_type == DeviceType.CUDA:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        elif not cuda and e.device_type == DeviceType.CPU:
            t = e.self_cpu_time_total
        else:
            continue
        us[e.key] = us.get(e.key, 0) + t
    if not us:
        raise RuntimeError(f"the profiler recorded no {'CUDA kernel' if cuda else 'CPU op'}")
    total = sum(us.values())
    shares = {k: 0.0 for k in (*KINDS, "other")}
    for key, t in us.items():
        shares[kind_of(key)] += t / total
    top = sorted(us.items(), key=lambda kv: -kv[1])[:12]
    r.update(timed="CUDA kernels" if cuda else "CPU ops", total_ms=total / 1e3,
             shares=shares, top=[{"name": k[:160], "ms": t / 1e3, "kind": kind_of(k)} for k, t in top],
             attention_kernels=sorted(k[:160] for k in us if kind_of(k) == "attention"))


STAGES = {"env": env, "nan": nan, "train": train, "bisect": bisect, "trainpy": trainpy, "decode": decode_stage,
          "compiled": compiled, "profile": profile}
