# The speed knob's curves (docs/method.md §6, §9): accuracy against tokens per forward for each rule,
# raw tau, base-checked verify and exact verify, on the demo and on the real model, from eval.py
# summaries; the calibrated tau that kept models' summaries hold (docs/method.md §16, removed) stays on
# their panels. Writes results/knob.json (a row per model and mode, naming its rule and setting, with the
# per-slot repeat rates) and results/knob.png (one panel per model, one line per rule).
#   python -m tools.knob_report --runs demo=runs/demoq/knob.json coder05=runs/real4/knob.json,runs/real4/arm1.json
#   python -m tools.knob_report --keep results/knob.json --runs coder05-arm5=...   # adds a model to the report
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mars import cli
from mars.eval import beside
from mars.files import write_atomic
from tools.real_report import rule

RULES = ("exact", "raw", "calibrated", "base-checked")


@dataclass
class Settings:
    runs: list[str] = field(default_factory=list)  # MODEL=SUMMARY[,SUMMARY...]: eval.py summaries, merged by mode
    out: str = "results/knob"  # writes OUT.json and OUT.png
    keep: str = ""  # an earlier OUT.json whose models stay (their runs are gone); a model in --runs replaces its own


def rows_of(summary: dict) -> list[dict]:
    rows = []
    for mode, st in summary.items():
        if mode == "settings":
            continue
        accepts, repeats = st.get("slot_accepts") or [], st.get("slot_repeats") or []
        paired = st.get("paired_vs_baseline") or {}
        rows.append({"mode": mode, **rule(mode), "accuracy": st["accuracy"], "problems": st["problems"],
                     "tokens_per_forward": st["tokens_per_forward"],
                     "repeat_rate_per_slot": [r / a if a else None for a, r in zip(accepts, repeats)],
                     **({"vs_baseline": paired["difference"], "vs_baseline_se": paired["difference_se"],
                         "identical_replies": paired["identical_replies"]} if paired else {})})
    return rows


def plot(report: dict, path: Path) -> None:
    matplotlib = cli.optional("matplotlib", "tools/knob_report.py's plot", "requirements-extras.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["models"]), figsize=(5.5 * len(report["models"]), 4.4), squeeze=False)
    for ax, (model, rows) in zip(axes[0], report["models"].items()):
        for i, name in enumerate(RULES):
            pts = sorted((r["tokens_per_forward"], r["accuracy"]) for r in rows if r["rule"] == name)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=name)
        ax.set_title(f"{model}: {rows[0]['problems']} problems", fontsize=9)
        ax.set_xlabel("tokens per forward")
        ax.set_ylabel("accuracy / pass@1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "The speed knob's curves: accuracy against tokens per forward per rule.")
    if not (s.runs or s.keep) or any("=" not in spec or not spec.partition("=")[0] for spec in s.runs):
        sys.exit("error: --runs MODEL=SUMMARY[,SUMMARY...]: name each model's eval.py summaries, e.g. --runs "
                 "coder05=runs/coder/knob.json")
    if missing := [f for spec in s.runs for f in spec.partition("=")[2].split(",") if not Path(f).is_file()]:
        sys.exit(f"error: --runs: {missing[0]} is not there; give eval.py --out summaries")
    kept = json.loads(Path(s.keep).read_text()) if s.keep else {"models": {}}
    report = {"sources": asdict(s), "models": dict(kept["models"])}
    for spec in s.runs:
        model, _, files = spec.partition("=")
        merged = {}
        for f in files.split(","):
            merged |= json.loads(Path(f).read_text())
        order = lambda r: (RULES.index(r["rule"]), r["tokens_per_forward"])  # noqa: E731
        report["models"][model] = sorted(rows_of(merged), key=order)
    out = Path(s.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(beside(out, ".json"), json.dumps(report, indent=1) + "\n")
    plot(report, beside(out, ".png"))
    for model, rows in report["models"].items():
        print(f"| {model} | mode | rule | accuracy | tokens/forward | repeat rate, slots 1-3 |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            rates = ", ".join("-" if x is None else f"{100 * x:.1f}%" for x in r["repeat_rate_per_slot"][1:4])
            print(f"| | {r['mode']} | {r['rule']} | {r['accuracy']:.1f} | {r['tokens_per_forward']:.2f} | {rates} |")


if __name__ == "__main__":
    main()
