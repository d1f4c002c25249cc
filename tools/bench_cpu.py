# Decoding on a CPU beside llama.cpp: tokens/s at batch 1 on the same threads, in one run that alternates
# llama.cpp's llama-bench with ours, round after round (docs/benchmarks.md). Ours: AR (tau 1) on the base and
# exact self-verification (§9) on a MARS checkpoint (a gated adapter run keeps the base's output), each with
# float weights and with each --quantize kind (int4: the project's kernel, int4-torch: torch's). The prompts
# are the first --problems HumanEval prompts as eval.py renders them, one at a time; each decodes
# --max-new-tokens or to its stop token.
#
# llama-bench's tg test times generation alone (-p 0 -n N: N tokens, after an empty context at -d 0), so ours
# is timed the same way: from the token the prompt's forward gives to the last one (end-to-end tokens/s, the
# prompt's forward included, beside it). Ours attends to the prompt, so llama-bench also runs at -d D, D the
# prompts' mean length: the like-for-like row.
#
#   python -m tools.bench_cpu --base runs/real/coder05 --mars runs/coder/arm9 --gguf runs/real/coder05.gguf \
#       --llama-bench llama.cpp/build/bin/llama-bench --json results/cpu_vs_llamacpp.json
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from generate import Options, decode
from mars import budget, cli, cpu_kernels, quantize
from mars.checkpoint import check_checkpoint, load_model, trained_block_size
from mars.cli import device_and_dtype
from mars.eval import code_prompt, humaneval_problems
from mars.files import write_atomic
from mars.tokenizer import Tokenizer
from tools.forward_cost import cpu_name


@dataclass
class Settings:
    base: str = ""  # the plain checkpoint: the AR rows
    mars: str = ""  # a MARS checkpoint of the same base, e.g. a gated adapter run: the verify rows; empty = none
    gguf: str = ""  # the GGUF that llama-bench runs; empty = no llama.cpp rows
    llama_bench: str = ""  # llama.cpp's llama-bench binary (built with cmake --target llama-bench)
    quantize: list[str] = field(default_factory=lambda: ["none", *quantize.KINDS])  # weights of each of our rows
    threads: int = 2  # torch's threads and llama-bench -t
    problems: int = 8  # the first N HumanEval prompts, chosen before any run
    max_new_tokens: int = 64  # per prompt; llama-bench -n
    block_size: int = 0  # B of the verify rows; 0 = the one --mars was trained with
    draft_budget: str = "auto"  # the verify rows' tree, as generate.py's flag: auto = sized from t(n) measured
    # here for each weights' kernels (mars/budget.py); N positions per row; 0 = the full tree
    rounds: int = 2  # llama.cpp, then every row of ours, this many times; medians
    llama_reps: int = 3  # llama-bench -r within a round
    json: str = ""  # also write every measurement to this JSON file


def llama_round(s: Settings, depth: int) -> list[dict]:
    # One llama-bench run: its tg test after 0 and `depth` tokens of context, --llama-reps repetitions each ->
    # its JSON records (n_depth, avg_ts, samples_ts, ...).
    cmd = [s.llama_bench, "-m", s.gguf, "-t", str(s.threads), "-p", "0", "-n", str(s.max_new_tokens),
           "-d", f"0,{depth}", "-r", str(s.llama_reps), "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    records = json.loads(run.stdout)
    for record in records:
        record["model_filename"] = Path(record.get("model_filename", "")).name  # no machine's path in the results
    return records


def timed_decode(model, prompt: list[int], tok: Tokenizer, opts: Options) -> dict:
    # One prompt at batch 1 -> its tokens, and the seconds to the first token and from it to the last.
    marks = []
    t0 = time.perf_counter()
    out, forwards = decode(model, [prompt], tok.mask_id, tok.stop_ids, opts,
                           on_accept=lambda b, new: marks.append((time.perf_counter(), len(new))))
    end = time.perf_counter()
    return dict(tokens=out[0], forwards=forwards[0], first_s=marks[0][0] - t0, generation_s=end - marks[0][0],
                generated_after_first=len(out[0]) - marks[0][1])


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Decoding tokens/s on a CPU beside llama.cpp's llama-bench, alternated.")
    if not s.base:
        sys.exit("error: pass --base DIR, the plain checkpoint (and --mars DIR for the verify rows)")
    if bool(s.gguf) != bool(s.llama_bench):
        sys.exit("error: --gguf and --llama-bench go together (or drop both for our rows alone)")
    if not (s.draft_budget == "auto" or s.draft_budget.isdigit()):
        sys.exit(f"error: --draft-budget {s.draft_budget}: auto, or positions per row (0: the full tree)")
    for name in ("threads", "problems", "rounds", "llama_reps"):
        if getattr(s, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.max_new_tokens < 2:
        sys.exit(f"error: --max-new-tokens {s.max_new_tokens}: the speed is timed from the first token on, so at "
                 "least 2")
    if s.json:  # found now, not after every round
        cli.output_file(s.json, "--json")
    torch.set_num_threads(s.threads)
    try:
        path = check_checkpoint(s.base)[0]
        tok = Tokenizer.from_pretrained(path)
        mars_path = check_checkpoint(s.mars)[0] if s.mars else None
        B = trained_block_size(mars_path, s.block_size) if mars_path else 0
        problems = humaneval_problems()[:s.problems]
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    prompts = [tok.encode_chat([{"role": "user", "content": code_prompt(p["prompt"])}], add_generation_prompt=True)
               for p in problems]
    depth = round(statistics.mean(map(len, prompts)))
    try:  # an unknown kind, or one this machine has no kernel for: one line, before loading a model
        for q in s.quantize:
            quantize.check(q, *device_and_dtype("cpu", "bfloat16", q))
    except ValueError as e:
        sys.exit(f"error: {e}")

    rows, t_of_n = {}, {}  # (method, quantize) -> (model, Options); float rows in bfloat16, as the kernels run
    for q in s.quantize:
        device, dtype = device_and_dtype("cpu", "bfloat16", q)
        ar = Options(tau=1.0, max_new_tokens=s.max_new_tokens, vocab_size=tok.vocab_size)  # as generate.py decodes
        rows["AR", q] = (load_model(path, device, dtype, quantize=q), ar)
        if mars_path:
            model = load_model(mars_path, device, dtype, quantize=q)
            n = 0 if s.draft_budget == "auto" else int(s.draft_budget)
            if s.draft_budget == "auto":  # as generate.py --verify measures it: one row, these kernels
                n, ns, seconds = budget.measured_budget(model, 1, B - 1)
                t_of_n[q] = {"positions": ns, "ms": [1e3 * t for t in seconds], "draft_budget": n}
            opts = Options(B=B, verify=True, max_new_tokens=s.max_new_tokens, draft_budget=n, vocab_size=tok.vocab_size)
            rows["exact verify", q] = (model, opts)
    machine = cpu_name()
    print(f"{machine}; torch {torch.__version__}, {s.threads} threads; {len(prompts)} HumanEval prompts, "
          f"{s.max_new_tokens} new tokens each", file=sys.stderr, flush=True)
    for model, opts in rows.values():  # warm-up: kernels, the allocator
        decode(model, [prompts[0]], tok.mask_id, tok.stop_ids, opts)

    llama, ours = [], {key: [] for key in rows}
    for r in range(s.rounds):
        if s.gguf:
            llama += llama_round(s, depth)
            print(f"round {r + 1}: llama.cpp " + ", ".join(f"{x['avg_ts']:.1f} tok/s after {x['n_depth']}"
                                                           for x in llama[-2:]), file=sys.stderr, flush=True)
        for key, (model, opts) in rows.items():
            ours[key].append([timed_decode(model, p, tok, opts) for p in prompts])
            runs = ours[key][-1]
            if not any(x["generated_after_first"] for x in runs):  # tokens/s would read 0, the tokens "the same"
                sys.exit(f"error: {key[0]} {key[1]}: every reply ended at its first token, so there is no decoding "
                         "to time; --base and --mars must be chat models whose replies run on (is this a base model, "
                         "or broken weights?)")
            tps = sum(x["generated_after_first"] for x in runs) / sum(x["generation_s"] for x in runs)
            print(f"round {r + 1}: {key[0]} {key[1]} {tps:.1f} tok/s", file=sys.stderr, flush=True)

    results = []
    for d in (0, depth) if llama else ():
        tps = [x["avg_ts"] for x in llama if x["n_depth"] == d]
        results.append(dict(what=f"llama.cpp {llama[0].get('model_type', '')}, context {d}", method="AR",
                            quantize="gguf", context=d, tokens_per_second=statistics.median(tps), per_round=tps,
                            tokens_per_forward=1.0))
    for (method, q), per_round in ours.items():
        gen = [sum(x["generated_after_first"] for x in runs) / sum(x["generation_s"] for x in runs)
               for runs in per_round]
        e2e = [sum(len(x["tokens"]) for x in runs) / sum(x["first_s"] + x["generation_s"] for x in runs)
               for runs in per_round]
        last = per_round[-1]
        ar_tokens = [x["tokens"] for x in ours["AR", q][-1]]
        model = rows[method, q][0]
        results.append(dict(
            what=f"ours {method}", method=method, quantize=q, context=depth, tokens_per_second=statistics.median(gen),
            # the kernels that ran: the linears' (int4 runs torch's where mars/cpu_kernels.cpp cannot), the adapter's
            kernel=getattr(model.lm_head, "kind", "float"),
            adapter_kernel=None if getattr(model, "adapter", None) is None else
            "mars/cpu_kernels.cpp" if model.adapter.lowrank else "torch matmuls",
            per_round=gen, end_to_end_tokens_per_second=statistics.median(e2e),
            tokens_per_forward=sum(len(x["tokens"]) for x in last) / sum(x["forwards"] for x in last),
            new_tokens=sum(len(x["tokens"]) for x in last),
            draft_budget=rows[method, q][1].draft_budget if method != "AR" else None,
            same_tokens_as_ar=sum(x["tokens"] == a for x, a in zip(last, ar_tokens)),
            # the quantized weights' drift: replies equal to bf16 AR's (their greedy text need not be)
            same_tokens_as_bf16_ar=sum(x["tokens"] == a["tokens"] for x, a in zip(last, ours["AR", "none"][-1]))
            if ("AR", "none") in ours else None))
    # ours against llama.cpp after the same context (the prompts' mean length), and after none (-d 0)
    refs = [r["tokens_per_second"] for r in results[:2]] if llama else []
    print(f"\n{machine}, {s.threads} threads, batch 1, {s.max_new_tokens} new tokens, median of {s.rounds} rounds; "
          f"ours after {depth} tokens of prompt on average")
    print("| decoding | weights | tok/s | vs llama.cpp (same context, none) | tokens/forward | same tokens as AR "
          "(its weights, bf16) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        vs = f"{r['tokens_per_second'] / refs[1]:.2f}x, {r['tokens_per_second'] / refs[0]:.2f}x" if refs else "-"
        same = "-" if "same_tokens_as_ar" not in r else f"{r['same_tokens_as_ar']}/{len(prompts)}, " + (
            "-" if r["same_tokens_as_bf16_ar"] is None else f"{r['same_tokens_as_bf16_ar']}/{len(prompts)}")
        print(f"| {r['what']} | {r['quantize']} | {r['tokens_per_second']:.1f} | {vs} | "
              f"{r['tokens_per_forward']:.2f} | {same} |")
    if s.json:
        paths = {k: Path(getattr(s, k)).name for k in ("base", "mars", "gguf", "llama_bench", "json")}
        record = {"settings": {**asdict(s), **paths, "block_size": B}, "cpu": machine,
                  "cpu_kernels": cpu_kernels.loaded_build(), "torch": torch.__version__, "results": results,
                  "t_of_n": t_of_n, "llama_bench": llama, "prompts": [p["task_id"] for p in problems],
                  "outputs": {f"{m} {q}": [tok.decode(x["tokens"]) for x in per_round[-1]]
                              for (m, q), per_round in ours.items()}}
        write_atomic(Path(s.json), json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
