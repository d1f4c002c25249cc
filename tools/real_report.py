# Gathers the real-model run (README, "A real model on a CPU") into results/real.json and
# results/real.png: eval.py summaries of the base and the MARS model, and the training curves.
#   python -m tools.real_report --base runs/real/base.json --mars runs/real/mars.json \
#       --batch1 runs/real/batch1.json --metrics runs/real/mars/metrics.jsonl
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import cli


@dataclass
class Settings:
    base: str = "runs/real/base.json"  # eval.py summary of the untrained instruct model (mode ar)
    mars: str = "runs/real/mars.json"  # eval.py summary of the MARS model, all modes, one batch size
    batch1: str = ""  # eval.py summary of the MARS model at batch 1 (speed), optional
    metrics: str = "runs/real/mars/metrics.jsonl"  # train.py's metrics of the MARS run
    out: str = "results/real"  # writes OUT.json and OUT.png


def load(path: str) -> dict:
    return json.loads(Path(path).read_text()) if path else {}


def plot(report: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    mars = {m: r for m, r in report["mars"].items() if m != "settings"}
    taus = sorted(((float(m), r) for m, r in mars.items() if m[0].isdigit()), reverse=True)
    if "ar" in mars:
        taus = [(1.0, mars["ar"])] + [t for t in taus if t[0] < 1.0]
    ax.plot([r["tokens_per_forward"] for _, r in taus], [r["accuracy"] for _, r in taus], "o-",
            label="MARS, threshold (one point per tau)")
    for tau, r in taus:
        ax.annotate(f"τ={tau:g}", (r["tokens_per_forward"], r["accuracy"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    for i, (m, r) in enumerate((m, r) for m, r in mars.items() if m.startswith("verify")):
        ax.scatter([r["tokens_per_forward"]], [r["accuracy"]], marker="D", s=50, color=f"C{i + 2}",
                   label=f"MARS, {m} (lossless)", zorder=3)
    ax.scatter([1.0], [report["base_same_problems"]["accuracy"]], marker="*", s=150, color="C3",
               label="base instruct model, AR (same problems)", zorder=3)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("HumanEval pass@1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    train = [r for r in rows if "loss_mask" in r]
    for key in ("loss_ar", "loss_mask"):
        bx.plot([r["step"] for r in train], [r[key] for r in train], label=key, alpha=0.8)
    evals = [r for r in rows if "eval_loss_mask" in r]
    for key in ("eval_loss_ar", "eval_loss_mask"):
        bx.plot([r["step"] for r in evals], [r[key] for r in evals], "o--", label=key, ms=4)
    bx.set_yscale("log")
    bx.set_xlabel("optimizer step")
    bx.set_ylabel("cross-entropy")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle("Qwen2.5-Coder-0.5B-Instruct (Q4, dequantized), MARS on a CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Collect the real-model results into one JSON and a plot.")
    rows = [json.loads(line) for line in Path(s.metrics).read_text().splitlines()]
    # The base model on exactly the problems the MARS model was scored on (eval.py --limit N).
    def samples(path: str) -> list[dict]:
        return [json.loads(line) for line in Path(path).with_suffix(".samples.jsonl").read_text().splitlines()]

    ids = {r["id"] for r in samples(s.mars)}
    same = [r for r in samples(s.base) if r["id"] in ids and r["mode"] == "ar"]
    report = {"base": load(s.base), "mars": load(s.mars), "mars_batch1": load(s.batch1),
              "base_same_problems": {"problems": len(same),
                                     "accuracy": 100 * sum(r["passed"] for r in same) / len(same)},
              "train": {"steps": max(r["step"] for r in rows), "first": rows[1] if len(rows) > 1 else rows[0],
                        "last": [r for r in rows if "loss" in r][-1],
                        "seconds": sum(r.get("dt", 0) for r in rows)},
              "sources": asdict(s)}
    out = Path(s.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
