# The paper's story in miniature, on a CPU (docs/method.md §5, §8):
#   1. synthetic chat tasks with checkable answers (mars/tasks.py);
#   2. stage 1: AR SFT of a tiny random byte-level Qwen2 (train.py --mode ar);
#   3. stage 2: MARS from the stage-1 checkpoint, same data, same number of steps (train.py --mode
#      mars), and, as a control, stage 1 continued as plain AR SFT for as many steps. Equal steps,
#      not equal compute: a MARS step costs about 2x an AR step (docs/method.md §5);
#   4. accuracy of both on held-out tasks, then a tau sweep and self-verification (§9, both layouts):
#      accuracy, tokens per forward, and the wall-clock speed-up over AR decoding with a KV cache at
#      batch 1 and batch 8.
# Writes results/demo.json and results/demo.png; --quick writes all of its files under runs/quickstart and
# data/quickstart instead, so it never overwrites the full run's results that the README shows.
#   python -m tools.demo            # the full run (make demo)
#   python -m tools.demo --quick    # about 3 minutes on 2 cores, to see it work (make quickstart)
from __future__ import annotations

import json
import math
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import train
from generate import Options, decode
from mars import cli, tasks
from mars.checkpoint import PROGRESS_SECONDS, load_model
from mars.layout import LAYOUTS, Stats
from mars.tokenizer import Tokenizer
from model import Transformer


@dataclass
class Settings:
    quick: bool = False  # a smaller run: fewer steps and test prompts
    data: str = "data/demo"  # where mars/tasks.py writes train.jsonl and test.jsonl (--quick: data/quickstart)
    out: str = "runs/demo"  # stage checkpoints go to OUT/ar and OUT/mars (--quick: runs/quickstart)
    results: str = "results"  # demo.json and demo.png (--quick: runs/quickstart, never the tracked results/)
    n_train: int = 64000  # synthetic training examples; a stage sees each at most once
    n_test: int = 300  # held-out examples for accuracy
    steps: int = 4000  # optimizer steps per stage (every stage takes the same number)
    batch_size: int = 8  # sequences per step: on a CPU, many small steps learn most per second
    lr: float = 2e-3  # peak learning rate for the tiny model
    block_size: int = 4  # B, for training and decoding
    thresholds: list[float] = field(default_factory=lambda: [1.0, 0.99, 0.95, 0.9, 0.8, 0.7, 0.5])  # tau sweep
    max_new_tokens: int = 128  # per prompt
    speed_prompts: int = 16  # test prompts timed for the speed-up
    speed_reps: int = 3  # interleaved repetitions; medians are reported
    seed: int = 0  # data, model and order


QUICK = dict(n_train=12000, n_test=60, steps=800, speed_prompts=4, speed_reps=1, data="data/quickstart",
             out="runs/quickstart", results="runs/quickstart")


def parse_settings(argv: list[str] | None) -> Settings:
    # --quick is a preset: it changes the defaults, and an explicit flag still wins.
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    return cli.parse(Settings, argv, "The CPU demo: AR SFT, then MARS, then a tau sweep.", QUICK if quick else None,
                     check=check_settings)


def check_settings(s: Settings) -> None:
    # What the flags alone show to be wrong (a usage error), before minutes of training: the paths too.
    for name in ("n_train", "n_test", "steps", "batch_size", "block_size", "max_new_tokens", "speed_prompts",
                 "speed_reps"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if not s.lr > 0:
        raise ValueError(f"--lr {s.lr} must be > 0")
    if not s.thresholds or not all(0 <= t <= 1 for t in s.thresholds):
        raise ValueError(f"--thresholds {' '.join(map(str, s.thresholds))}: taus in [0, 1]")
    for flag, path in (("--data", s.data), ("--out", s.out), ("--results", s.results)):
        if Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"{flag} {path} is a file: the demo writes a folder there; choose another {flag}")


class Progress:
    # The demo's progress lines, flushed as they are printed (a pipe, `tee` or nohup would hold them until
    # its buffer fills): each piece of work's own line, and inside a long one a line at least every
    # PROGRESS_SECONDS, as train.py prints its steps off a terminal.
    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now, self.last = now, now()

    def __call__(self, text: str, always: bool = True) -> None:
        if always or self.now() - self.last >= PROGRESS_SECONDS:
            print(text, flush=True)
            self.last = self.now()


def evaluate(model: Transformer, tok: Tokenizer, examples: list[dict], tau: float, s: Settings,
             batch: int = 64, layout: str = "", progress: Callable[[str], None] | None = None,
             ) -> tuple[dict, list[list[int]]]:
    # Exact-match accuracy of the checked answer, per family and overall, and tokens per forward; and
    # the outputs. layout: self-verification (§9) in that layout instead of the threshold tau. progress:
    # told how many prompts are done after each batch.
    correct, new, forwards, outputs, drafts = {}, 0, 0, [], Stats()
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        prompts = [tok.encode_chat(e["messages"][:-1], add_generation_prompt=True) for e in chunk]
        opts = Options(tau=tau, B=s.block_size, max_new_tokens=s.max_new_tokens, verify=bool(layout),
                       layout=layout or "tree", vocab_size=tok.vocab_size)
        outs, f = decode(model, prompts, tok.mask_id, tok.stop_ids, opts, stats=drafts)
        for e, o in zip(chunk, outs):
            text = tok.decode([t for t in o if t not in tok.stop_ids])
            correct.setdefault(e["family"], []).append(tasks.is_correct(e, text))
        new, forwards, outputs = new + sum(map(len, outs)), forwards + sum(f), outputs + outs
        if progress:
            progress(f"{i + len(chunk)}/{len(examples)} prompts")
    per_family = {k: 100 * sum(v) / len(v) for k, v in sorted(correct.items())}
    everything = [c for v in correct.values() for c in v]
    p, n = sum(everything) / len(everything), len(everything)
    # One seed: the binomial standard error over the n prompts is the only spread this run can give.
    result = {"accuracy": 100 * p, "accuracy_se": 100 * math.sqrt(p * (1 - p) / n), "n": n,
              "per_family": per_family, "tokens_per_forward": new / forwards}
    if layout:
        offered, accepted = sum(drafts.offered), sum(drafts.accepted)
        result |= {"drafts_offered": offered, "drafts_accepted": accepted, "acceptance_rate": accepted / offered}
    return result, outputs


def tokens_per_second(model: Transformer, tok: Tokenizer, prompts: list[list[int]], batch: int,
                      tau: float, B: int, s: Settings, layout: str = "") -> float:
    # Every batch size runs on the cursor cache: AR (B = 1, tau = 1) and MARS run through the same
    # cached code, so the ratio is the method's.
    new, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        opts = Options(tau=tau, B=B, max_new_tokens=s.max_new_tokens, verify=bool(layout), layout=layout or "tree",
                       vocab_size=tok.vocab_size)
        outs, _ = decode(model, prompts[i:i + batch], tok.mask_id, tok.stop_ids, opts)
        new += sum(map(len, outs))
    return new / (time.perf_counter() - t0)


def speedups(model: Transformer, ar_model: Transformer, tok: Tokenizer, examples: list[dict],
             taus: list[float], s: Settings, progress: Callable[..., None] = print) -> dict:
    # Interleaved repetitions: every configuration is timed once per round, so drift hits all alike.
    # Keys: (tau or a verify layout's name, batch size).
    prompts = [tok.encode_chat(e["messages"][:-1], add_generation_prompt=True)
               for e in examples[:s.speed_prompts]]
    runs: dict[tuple, list[float]] = {}
    t0 = time.perf_counter()
    for rep in range(s.speed_reps):
        for batch in (1, 8):
            runs.setdefault(("ar", batch), []).append(tokens_per_second(ar_model, tok, prompts, batch, 1.0, 1, s))
            for tau in taus:
                runs.setdefault((tau, batch), []).append(
                    tokens_per_second(model, tok, prompts, batch, tau, s.block_size, s))
                progress(f"  speed, round {rep + 1}/{s.speed_reps}, batch {batch}: tau {tau} timed", always=False)
            for layout in LAYOUTS:
                runs.setdefault((layout, batch), []).append(
                    tokens_per_second(model, tok, prompts, batch, 1.0, s.block_size, s, layout))
            progress(f"  speed, round {rep + 1}/{s.speed_reps}, batch {batch}: AR, {len(taus)} taus and "
                     f"{len(LAYOUTS)} verify layouts timed ({time.perf_counter() - t0:.0f} s)")
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {(mode, batch): med[(mode, batch)] / med[("ar", batch)] for mode in [*taus, *LAYOUTS]
            for batch in (1, 8)} | {("ar_tok_s", batch): med[("ar", batch)] for batch in (1, 8)}


def plot(results: dict, path: Path) -> None:
    try:
        matplotlib = cli.optional("matplotlib", "the demo's plot", "requirements-extras.txt")
    except SystemExit as e:  # the numbers are the demo's result; the plot is a view of them
        print(f"{e}; skipping the plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 4))
    xs = [r["tokens_per_forward"] for r in results["mars"]]
    ys = [r["accuracy"] for r in results["mars"]]
    ax.plot(xs, ys, "o-", label="MARS, one point per tau")
    for r in results["mars"]:
        ax.annotate(f"τ={r['threshold']}", (r["tokens_per_forward"], r["accuracy"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    for r, marker, color in zip(results["verify"], "Ds", ("C4", "C1")):  # exact: tau 1.0's accuracy
        ax.scatter([r["tokens_per_forward"]], [r["accuracy"]], marker=marker, s=70, color=color, zorder=4,
                   label=f"MARS verify, {r['layout']} (= τ 1.0 tokens)")
    ax.scatter([1.0], [results["ar_sft"]["accuracy"]], marker="*", s=150, color="C3", label="AR SFT", zorder=3)
    ax.scatter([1.0], [results["ar_sft_2x_steps"]["accuracy"]], marker="x", s=60, color="C2",
               label="AR SFT, 2x steps (control)", zorder=3)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title("Tiny byte-level model on the synthetic tasks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    s = parse_settings(argv)
    print(f"demo settings: {asdict(s)}", flush=True)
    say = Progress()
    torch.manual_seed(s.seed)
    t_start = time.perf_counter()
    data, out, res = Path(s.data), Path(s.out), Path(s.results)
    tasks.write_splits(data, s.n_train, s.n_test, s.seed)

    # ---- stage 1 (AR SFT) and stage 2 (MARS from stage 1): the same data and number of steps ----
    common = ["--data", str(data / "train.jsonl"), "--max-steps", str(s.steps), "--batch-size",
              str(s.batch_size), "--global-batch", str(s.batch_size), "--lr", str(s.lr),
              "--block-size", str(s.block_size),
              "--max-len", "256", "--eval-every", "0", "--save-every", "0", "--seed", str(s.seed),
              "--device", "cpu", "--dtype", "float32", "--quiet", "--log-every", str(s.steps)]  # a line a stage
    for stage in ("ar", "ar2", "mars"):  # a demo run starts afresh; train.py would refuse a used --out
        if (out / stage).exists():
            print(f"removing the previous run's {out / stage}", flush=True)
            shutil.rmtree(out / stage)
    print("\n==== stage 1 of 3: AR SFT ====", flush=True)
    train.main(["--init", "tiny", "--mode", "ar", "--out", str(out / "ar"), *common])
    print("\n==== stage 2 of 3: MARS from stage 1 ====", flush=True)
    train.main(["--init", str(out / "ar"), "--mode", "mars", "--out", str(out / "mars"), *common])
    # The control: does MARS at tau = 1 gain only from training twice as long?
    print("\n==== stage 3 of 3, the control: stage 1 continued as AR SFT, as many steps as stage 2 ====", flush=True)
    train.main(["--init", str(out / "ar"), "--mode", "ar", "--out", str(out / "ar2"), *common])
    t_train = time.perf_counter() - t_start

    # ---- accuracy and tokens per forward on held-out tasks ----
    tok = Tokenizer.from_pretrained(out / "mars")
    ar = load_model(out / "ar", dtype=torch.float32)
    mars = load_model(out / "mars", dtype=torch.float32)
    test = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()][:s.n_test]
    taus = s.thresholds
    say(f"\n==== evaluating on {len(test)} held-out prompts ====")

    def scored(name: str, model: Transformer, tau: float, layout: str = "") -> tuple[dict, list[list[int]]]:
        t0 = time.perf_counter()
        result, outs = evaluate(model, tok, test, tau, s, layout=layout,
                                progress=lambda done: say(f"  {name}: {done}", always=False))
        say(f"  {name}: accuracy {result['accuracy']:.1f}%, {result['tokens_per_forward']:.2f} tokens/forward "
            f"({time.perf_counter() - t0:.0f} s)")
        return result, outs

    ar_eval, _ = scored("AR SFT", ar, 1.0)
    ar2 = load_model(out / "ar2", dtype=torch.float32)
    ar2_eval, _ = scored("AR SFT, 2x steps", ar2, 1.0)
    sweep, outputs = [], {}
    for tau in taus:
        result, outputs[tau] = scored(f"MARS tau {tau}", mars, tau)
        sweep.append({"threshold": tau, **result})
    greedy = outputs[1.0] if 1.0 in outputs else evaluate(mars, tok, test, 1.0, s)[1]  # MARS at tau 1.0
    verify = []
    for layout in LAYOUTS:  # self-verification (§9): the answers must be tau 1.0's, token for token
        result, outputs = scored(f"MARS verify, {layout}", mars, 1.0, layout)
        verify.append({"layout": layout, **result, "same_tokens_as_tau_1": outputs == greedy})
    say(f"\n==== timing the speed-up over AR with a KV cache: {min(s.speed_prompts, len(test))} prompts, "
        f"{s.speed_reps} interleaved round(s) ====")
    speed = speedups(mars, ar, tok, test, taus, s, say)
    for r in sweep:
        r["speedup_vs_ar_kv"] = speed[(r["threshold"], 1)]
        r["speedup_vs_ar_kv_batch8"] = speed[(r["threshold"], 8)]
    for r in verify:
        r["speedup_vs_ar_kv"] = speed[(r["layout"], 1)]
        r["speedup_vs_ar_kv_batch8"] = speed[(r["layout"], 8)]

    results = {
        "ar_sft": ar_eval,
        "ar_sft_2x_steps": ar2_eval,
        "mars": sweep,
        "verify": verify,
        "ar_kv_tokens_per_second": {"batch1": speed[("ar_tok_s", 1)], "batch8": speed[("ar_tok_s", 8)]},
        "config": {**asdict(s), "model": asdict(ar.config), "train_seconds": t_train,
                   "total_seconds": time.perf_counter() - t_start, "torch_threads": torch.get_num_threads()},
    }
    res.mkdir(parents=True, exist_ok=True)
    (res / "demo.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, res / "demo.png")

    def acc(e: dict) -> str:
        return f"{e['accuracy']:.1f} +- {e['accuracy_se']:.1f}"

    print(f"\n| model | tau | accuracy % +- s.e. (n = {ar_eval['n']}, one seed) | tokens/forward | speed-up b1 | "
          "speed-up b8 |")
    print("|---|---|---|---|---|---|")
    print(f"| AR SFT | 1.0 | {acc(ar_eval)} | 1.00 | 1.00 | 1.00 |")
    print(f"| AR SFT, 2x steps | 1.0 | {acc(ar2_eval)} | 1.00 | - | - |")
    for r in sweep:
        print(f"| MARS | {r['threshold']} | {acc(r)} | {r['tokens_per_forward']:.2f} | "
              f"{r['speedup_vs_ar_kv']:.2f} | {r['speedup_vs_ar_kv_batch8']:.2f} |")
    for r in verify:
        print(f"| MARS verify, {r['layout']} | exact | {r['accuracy']:.1f} | {r['tokens_per_forward']:.2f} | "
              f"{r['speedup_vs_ar_kv']:.2f} | {r['speedup_vs_ar_kv_batch8']:.2f} |")
    if s.speed_reps == 1:  # --quick
        print(f"caveat: these speed-ups come from a single timing of {min(s.speed_prompts, len(test))} prompts "
              "(--speed-reps 1): one timing on a small, busy CPU is noise. `make demo` reports the medians of "
              f"{Settings.speed_reps} interleaved rounds.")
    for r in verify:
        print(f"verify {r['layout']}: drafts accepted {r['drafts_accepted']}/{r['drafts_offered']} "
              f"({100 * r['acceptance_rate']:.1f}%), same tokens as tau 1.0: {r['same_tokens_as_tau_1']}")
    fams = list(ar_eval["per_family"])
    at = {r["threshold"]: r for r in sweep}
    taus = [t for t in (1.0, 0.9) if t in at]
    print("\nper family (" + " | ".join(["AR SFT", "AR SFT 2x steps", *(f"MARS tau={t}" for t in taus)]) + "):")
    for f in fams:
        row = [ar_eval["per_family"][f], ar2_eval["per_family"][f]]
        row += [at[t]["per_family"][f] for t in taus]
        print(f"  {f:10s} " + " | ".join(f"{v:5.1f}" for v in row))
    print(f"\nwrote {res / 'demo.json'} and {res / 'demo.png'} in {time.perf_counter() - t_start:.0f} s")
    print(next_commands(out / "mars", data / "test.jsonl", test[0]["messages"][0]["content"]))


def next_commands(ckpt: Path, test: Path, prompt: str) -> str:
    # What to try on the trained model next, each on the demo's own files.
    return "\n".join([
        "\nnext, try the MARS model yourself:",
        f"  python generate.py --ckpt {ckpt} --prompt {shlex.quote(prompt)} --threshold 0.9",
        f"  python serve.py --ckpt {ckpt}",
        f"  python eval.py --ckpt {ckpt} --task demo --data {test} --modes ar 0.9 verify",
    ])


if __name__ == "__main__":
    main()
