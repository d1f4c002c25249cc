# Gathers the real-model runs (README, "A real model on a CPU"; docs/real-model.md) into one table:
# results/real.json (the base and every arm, each with its modes, its paired comparison with the
# base, its settings and its training cost), results/real_samples/ARM.jsonl (a line per problem and
# mode) and results/real.png (pass@1 against tokens per forward).
#   python -m tools.real_report --runs runs/real2 --arms adapter ar-control
# For an arm NAME, RUNS holds NAME.json (eval.py, all 164 problems, batch 8, with --baseline base.json),
# optionally NAME-fp32.json (float32, paired with base-fp32.json) and NAME-b1.json (batch 1, ar against
# verify-tree), NAME/settings.json and NAME/metrics.jsonl (train.py) and NAME.train.log (/usr/bin/time -v).
# NAME=SUMMARY[,SUMMARY...] adds further eval.py runs on the same arm (the speed knob's modes, say), merged
# into NAME.json's modes, each with its SUMMARY's .samples.jsonl beside it.
# Earlier runs scored on the first 40 problems only come from their own summaries (--old), marked so.
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mars import cli
from mars.eval import beside
from mars.files import write_atomic

OLD = ["lr5e-6=results/real-lr5e-6.json", "lr5e-6-3ep=results/real-lr5e-6-3ep.json", "lr5e-5=results/real-lr5e-5.json"]


@dataclass
class Settings:
    runs: str = "runs/real2"  # the folder of the eval.py summaries and training runs
    arms: list[str] = field(default_factory=lambda: ["adapter", "ar-control", "mars-self"])  # NAME[=SUMMARY,...]
    old: list[str] = field(default_factory=lambda: OLD)  # NAME=FILE: earlier real_report outputs (first 40 problems)
    out: str = "results/real"  # writes OUT.json, OUT.png and OUT_samples/
    keep: str = ""  # an earlier OUT.json whose base and arms stay (their runs are gone); --arms add to it
    cost: str = "results/forward_cost.json"  # t(n), for each batch-1 mode's limit
    cost_model: str = "coder05"  # the model's curve in --cost
    batch1_more: list[str] = field(default_factory=list)  # NAME=LABEL:SUMMARY: a later batch-1 run on arm NAME
    # (a decoder change side by side, say), kept beside its planned one under batch1_more[LABEL]
    pick: str = ""  # the arm the plan's rule picks (docs/real-model.md), recorded with --pick-rule
    pick_rule: str = ""  # that rule, in words


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def modes(summary: dict) -> dict:
    # eval.py's summary without its settings: mode -> stats
    return {m: st for m, st in summary.items() if m != "settings"}


def peak_rss_gib(log: Path) -> float | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text()) if log.is_file() else None
    return int(m.group(1)) / 2**20 if m else None


def wall_minutes(log: Path) -> float | None:
    # /usr/bin/time -v's "Elapsed (wall clock) time (h:mm:ss or m:ss): 1:07:30.12": the whole process.
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log.read_text()) \
        if log.is_file() else None
    if not m:
        return None
    seconds = 0.0
    for part in m.group(1).split(":"):
        seconds = 60 * seconds + float(part)
    return seconds / 60


def json_row(line: str) -> dict | None:  # a JSONL row, or None for a line cut short
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def training(run: Path) -> dict:
    # A killed run's last row may be cut short: the whole rows are read, the rest left out.
    rows = [r for line in (run / "metrics.jsonl").read_text().splitlines() if (r := json_row(line)) is not None] \
        if (run / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return {"steps": len(steps), "minutes": sum(r["dt"] for r in steps) / 60 if steps else None,
            "seconds_per_step": sum(r["dt"] for r in steps) / len(steps) if steps else None,
            "first": steps[0] if steps else None, "last": steps[-1] if steps else None,
            "eval_first": evals[0] if evals else None, "eval_last": evals[-1] if evals else None}


MODE_KEYS = ("accuracy", "problems", "tokens_per_forward", "tokens_per_second", "speedup_vs_ar",
             "positions_per_forward", "slot_accepts", "slot_repeats")


def rule(mode: str) -> dict:
    # What a mode's row decodes by: "exact" (greedy AR, and verify at any budget or layout), "raw" (the
    # paper's threshold) or "base-checked" (verify with a tolerance), with its setting. "calibrated" names
    # the cal-TAU rows that committed summaries (results/real.json, results/knob.json) still hold: a rule
    # eval.py no longer runs (docs/method.md §16).
    if mode == "ar":
        return {"rule": "exact", "tau": 1.0}
    if mode.startswith("verify"):
        layout = mode.partition("-")[2]
        if layout.isdigit():
            return {"rule": "exact", "budget": int(layout)}
        if layout in ("tree", "chain"):
            return {"rule": "exact", "layout": layout, "budget": 0}
        from mars.budget import DEFAULT_BUDGET

        return {"rule": "exact", "budget": DEFAULT_BUDGET}
    if mode.startswith("cal-"):
        return {"rule": "calibrated", "tau": float(mode[4:])}
    if mode.startswith("tol-"):
        from mars.budget import DEFAULT_BUDGET

        return {"rule": "base-checked", "tolerance": float(mode[4:]), "budget": DEFAULT_BUDGET}
    return {"rule": "raw", "tau": float(mode)}


def limit(cost: dict, tokens_per_forward: float, positions: float | None) -> float | None:
    # The decode loop's ceiling at batch 1: (tokens per forward) x t(1) / t(n), n the positions fed.
    if not cost or positions is None:
        return None
    from mars.budget import interpolate

    lo, hi = int(positions), int(positions) + 1
    t = (interpolate(cost["n"], cost["seconds"], lo) * (hi - positions)
         + interpolate(cost["n"], cost["seconds"], hi) * (positions - lo))
    return tokens_per_forward * cost["seconds"][0] / t


def merged(paths: list[Path]) -> dict:
    # eval.py summaries of one arm in one: the first's settings, every run's modes.
    summary = read(paths[0])
    for path in paths[1:] if summary else []:
        summary |= modes(read(path))
    return summary


def arm(runs: Path, name: str, cost: dict | None = None, more: list[Path] | None = None) -> dict | None:
    summary = merged([runs / f"{name}.json", *(more or [])])
    if not summary:
        return None
    stats = modes(summary)
    entry = {"problems": max(st["problems"] for st in stats.values()),
             "modes": {m: {**rule(m), **{k: st[k] for k in MODE_KEYS if k in st}} for m, st in stats.items()},
             "paired_vs_base": {m: st["paired_vs_baseline"] for m, st in stats.items() if "paired_vs_baseline" in st},
             "settings": read(runs / name / "settings.json"), "eval_settings": summary.get("settings"),
             "train": training(runs / name), "peak_train_rss_gib": peak_rss_gib(runs / f"{name}.train.log"),
             "train_wall_minutes": wall_minutes(runs / f"{name}.train.log")}
    fp32 = modes(read(runs / f"{name}-fp32.json"))
    if fp32 and all("paired_vs_baseline" in st for st in fp32.values()):
        entry["float32"] = {m: {"problems": st["problems"], "accuracy": st["accuracy"],
                                "identical_to_base": round(st["paired_vs_baseline"]["identical_replies"]
                                                           * st["problems"]),
                                "tokens_per_forward": st["tokens_per_forward"]} for m, st in fp32.items()}
    elif fp32:  # an adapter's own ar is the base's greedy output (tested): its replies are the reference
        ref = {r["id"]: r["reply"] for r in samples_of(runs / f"{name}-fp32.samples.jsonl") if r["mode"] == "ar"}
        if not ref:
            raise SystemExit(f"{runs / f'{name}-fp32.samples.jsonl'}: no 'ar' replies to compare the modes with; "
                             "run the float32 check with --modes ar and the others, or --baseline the base's")
        entry["float32"] = {}
        for m, st in fp32.items():
            rows = [r for r in samples_of(runs / f"{name}-fp32.samples.jsonl") if r["mode"] == m]
            entry["float32"][m] = {"problems": st["problems"], "accuracy": st["accuracy"],
                                   "identical_to_base": sum(r["reply"] == ref[r["id"]] for r in rows),
                                   "tokens_per_forward": st["tokens_per_forward"], **rule(m)}
    b1 = batch1(read(runs / f"{name}-b1.json"), cost)
    if b1:
        entry["batch1"] = b1
    return entry


def batch1(summary: dict, cost: dict | None) -> dict:
    # A batch-1 run's modes: each one's speed-up over AR in the same run, and the limit the cost curve allows.
    return {m: {**rule(m), "problems": st["problems"], "tokens_per_second": st["tokens_per_second"],
                "tokens_per_forward": st["tokens_per_forward"], "speedup_vs_ar": st["speedup_vs_ar"],
                "positions_per_forward": st.get("positions_per_forward"),
                "limit_vs_ar": limit(cost, st["tokens_per_forward"], st.get("positions_per_forward"))}
            for m, st in modes(summary).items()}


def samples_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def old_arm(path: Path) -> dict | None:
    report = read(path)
    if not report:
        return None
    stats = modes(report["mars"])
    return {"problems": max(st["problems"] for st in stats.values()), "first_40_only": True,
            "modes": {m: {k: st[k] for k in ("accuracy", "problems", "tokens_per_forward", "tokens_per_second",
                                             "speedup_vs_ar")} for m, st in stats.items()},
            "paired_vs_base": None, "settings": report["mars"].get("settings"),
            "note": "scored on the first 40 problems before the paired comparison existed; its weights were not kept",
            "base_same_problems": report.get("base_same_problems")}


def samples(runs: Path, name: str, out: Path, more: list[Path] | None = None) -> int:
    src = runs / f"{name}.samples.jsonl"
    if not src.is_file():
        return 0
    rows = [r for p in [src, *(beside(m, ".samples.jsonl") for m in more or [])] for r in samples_of(p)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.jsonl").write_text("".join(
        json.dumps({"task_id": r["id"], "mode": r["mode"], "passed": r["passed"], "reply": r["reply"]}) + "\n"
        for r in rows))
    return len(rows)


MARKERS = {"ar": "o", "0.9": "s", "verify": "P", "verify-tree": "D", "verify-chain": "^"}


def base_accuracy(report: dict, old: bool) -> float | None:
    # The base's pass@1 on the problems of one panel: all 164, or the first 40 of the earlier runs.
    if not old:
        return report["base"]["modes"]["ar"]["accuracy"]
    same = [e.get("base_same_problems") or {} for e in report["arms"].values() if e.get("first_40_only")]
    return same[0].get("accuracy") if same else None


def plot(report: dict, path: Path) -> None:
    # Two panels, never one axis for different problem sets: all 164 problems (the base and the paired
    # arms), and the first 40 (the earlier runs, with the base on the same 40).
    matplotlib = cli.optional("matplotlib", "tools/real_report.py's plot", "requirements-extras.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 6.4), sharey=True)
    for ax, old in zip(axes, (False, True)):
        base = base_accuracy(report, old)
        if base is not None:
            ax.axhline(base, color="C3", ls=":", lw=1)
            ax.scatter([1.0], [base], marker="*", s=160, color="C3", label="base, AR", zorder=3)
        arms = [(n, e) for n, e in report["arms"].items() if bool(e.get("first_40_only")) == old]
        for i, (name, entry) in enumerate(arms):
            for m, st in entry["modes"].items():
                ax.scatter([st["tokens_per_forward"]], [st["accuracy"]], marker=MARKERS.get(m, "x"), s=45,
                           color=f"C{i}", label=f"{name}: {m}", zorder=3)
        ax.set_title("the first 40 problems (earlier runs)" if old else "all 164 problems, paired with the base",
                     fontsize=9)
        ax.set_xlabel("tokens per forward")
        ax.grid(alpha=0.3)
        many = len(ax.get_legend_handles_labels()[1]) > 8  # below the axes, in columns: it hides no point
        ax.legend(fontsize=6.5, ncol=3 if many else 1,
                  **{"loc": "upper center", "bbox_to_anchor": (0.5, -0.14)} if many else {"loc": "best"})
    axes[0].set_ylabel("HumanEval pass@1 (%)")
    fig.suptitle("Qwen2.5-Coder-0.5B-Instruct (Q4, dequantized), bf16, greedy, 512 new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Collect the real-model runs into one table, samples and a plot.")
    runs, out = Path(s.runs), Path(s.out)
    cost = read(Path(s.cost)).get("models", {}).get(s.cost_model, {}).get("bfloat16", {}).get("1")
    if s.keep:
        report, n = read(Path(s.keep)), 0
        report["sources"] = {"earlier": report.get("sources"), "added": asdict(s)}
        for entry in report["arms"].values():  # every mode row names its rule and setting
            for block in ("modes", "float32", "batch1"):
                for m, st in (entry.get(block) or {}).items():
                    st.update(rule(m))
        for m, st in report["base"]["modes"].items():
            st.update(rule(m))
    else:
        base = read(runs / "base.json")
        if not base:
            raise SystemExit(f"{runs / 'base.json'}: missing; run eval.py on the base model first (docs/real-model.md)")
        if "ar" not in base:
            has = ", ".join(k for k in base if k != "settings")
            raise SystemExit(f"{runs / 'base.json'}: no 'ar' mode (it has {has}); the base's run is eval.py --modes ar")
        report = {"base": {"problems": base["ar"]["problems"], "modes": modes(base), "eval_settings": base["settings"],
                           "float32": modes(read(runs / "base-fp32.json"))},
                  "arms": {}, "sources": asdict(s)}
        n = samples(runs, "base", Path(f"{out}_samples"))
    for spec in s.arms:
        name, _, extra = spec.partition("=")
        more = [Path(p) for p in extra.split(",") if p]
        entry = arm(runs, name, cost, more)
        if entry is None:
            print(f"{name}: no {runs / (name + '.json')}, left out")
            continue
        report["arms"][name] = entry
        n += samples(runs, name, Path(f"{out}_samples"), more)
    for spec in [] if s.keep else s.old:
        name, _, path = spec.partition("=")
        entry = old_arm(Path(path))
        if entry is not None:
            report["arms"][f"old {name}"] = entry
    for spec in s.batch1_more:
        name, _, rest = spec.partition("=")
        label, _, path = rest.partition(":")
        if name not in report["arms"] or not label or not read(Path(path)):
            raise SystemExit(f"--batch1-more {spec}: NAME=LABEL:SUMMARY, with NAME an arm of the table and "
                             "SUMMARY an eval.py summary")
        report["arms"][name].setdefault("batch1_more", {})[label] = batch1(read(Path(path)), cost)
    if s.pick:
        if s.pick not in report["arms"] or not s.pick_rule:
            raise SystemExit(f"--pick {s.pick}: name an arm of the table ({', '.join(report['arms'])}) "
                             "and give its --pick-rule")
        report["pick"] = {"arm": s.pick, "rule": s.pick_rule}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(beside(out, ".json"), json.dumps(report, indent=2) + "\n")
    plot(report, beside(out, ".png"))
    print(f"wrote {beside(out, '.json')}, {beside(out, '.png')} and {n} samples in {out}_samples/")


if __name__ == "__main__":
    main()
