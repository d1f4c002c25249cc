# tools/real_report.py: eval.py and train.py outputs of several arms -> one table, samples and a plot.
import json

import pytest

from tools import real_report


def summary(accuracy: float, problems: int, paired: bool = True, **modes) -> dict:
    out = {"settings": {"ckpt": "x"}}
    for m, tpf in (modes or {"ar": 1.0}).items():
        out[m] = {"accuracy": accuracy, "problems": problems, "tokens_per_forward": tpf, "tokens_per_second": 10 * tpf,
                  "speedup_vs_ar": None, "slot_accepts": [5], "slot_repeats": [1]}
        if paired:
            out[m]["paired_vs_baseline"] = {"identical_replies": 0.75, "both": 3}
    return out


def test_report_gathers_every_arm(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "base.json").write_text(json.dumps(summary(50.0, 4, paired=False)))
    (runs / "base.samples.jsonl").write_text(json.dumps({"mode": "ar", "id": "T/0", "passed": True, "reply": "r",
                                                         "prompt": "p"}) + "\n")
    (runs / "ad.json").write_text(json.dumps(summary(50.0, 4, **{"0.9": 1.6, "verify-tree": 2.7})))
    (runs / "ad-fp32.json").write_text(json.dumps(summary(50.0, 4, **{"verify-tree": 2.5})))
    (runs / "ad.samples.jsonl").write_text("".join(json.dumps({"mode": m, "id": "T/0", "passed": False,
                                                               "reply": "x", "prompt": "p"}) + "\n"
                                                   for m in ("0.9", "verify-tree")))
    (runs / "ad").mkdir()
    (runs / "ad" / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 3.0 / i, "dt": 6.0}) + "\n"
                                                       for i in (1, 2)) + '{"step": 3, "lo')  # a killed run's cut row
    (runs / "ad.train.log").write_text("\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.6\n"
                                       "\tMaximum resident set size (kbytes): 3145728\n")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"mars": summary(25.0, 40, paired=False, ar=1.0), "base_same_problems": {}}))
    out = tmp_path / "results" / "real"
    later = tmp_path / "later-b1.json"
    later.write_text(json.dumps(summary(50.0, 8, paired=False, ar=1.0, verify=2.5)))
    real_report.main(["--runs", str(runs), "--arms", "ad", "missing", "--old", f"first={old}", "--out", str(out),
                      "--pick", "ad", "--pick-rule", "the most tokens per forward",
                      "--batch1-more", f"ad=after-abc:{later}"])
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["arms"]) == {"ad", "old first"}  # a missing arm is left out, not invented
    ad = report["arms"]["ad"]
    assert ad["modes"]["verify-tree"]["tokens_per_forward"] == 2.7 and ad["problems"] == 4
    assert ad["paired_vs_base"]["0.9"]["both"] == 3
    assert ad["float32"]["verify-tree"]["identical_to_base"] == 3  # 0.75 of 4 problems
    assert ad["peak_train_rss_gib"] == 3.0 and ad["train"]["steps"] == 2 and ad["train"]["minutes"] == 0.2
    assert abs(ad["train_wall_minutes"] - (3600 + 120 + 3.6) / 60) < 1e-9  # the whole process, as time -v saw it
    assert report["pick"] == {"arm": "ad", "rule": "the most tokens per forward"}
    assert ad["batch1_more"]["after-abc"]["verify"]["tokens_per_forward"] == 2.5 and "batch1" not in ad
    assert ad["batch1_more"]["after-abc"]["verify"]["rule"] == "exact"
    with pytest.raises(SystemExit, match=r"--pick nope: name an arm of the table \(ad, old first\)"):
        real_report.main(["--runs", str(runs), "--arms", "ad", "--old", f"first={old}", "--out", str(out),
                          "--pick", "nope", "--pick-rule", "x"])
    assert report["arms"]["old first"]["first_40_only"] and report["arms"]["old first"]["paired_vs_base"] is None
    lines = [json.loads(line) for line in (tmp_path / "results" / "real_samples" / "ad.jsonl").read_text().splitlines()]
    assert [set(r) for r in lines] == [{"task_id", "mode", "passed", "reply"}] * 2
    assert out.with_suffix(".png").stat().st_size > 1000


def test_report_keeps_earlier_arms_names_every_rule_and_reads_an_adapters_own_float32_reference(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    earlier = {"base": {"problems": 4, "modes": {"ar": {"accuracy": 50.0, "tokens_per_forward": 1.0}}},
               "arms": {"old": {"problems": 4, "modes": {"0.9": {"accuracy": 25.0, "tokens_per_forward": 1.5},
                                                          "verify-tree": {"accuracy": 50.0, "tokens_per_forward": 2.3}},
                                "paired_vs_base": {}}}}
    keep = tmp_path / "real.json"
    keep.write_text(json.dumps(earlier))
    (runs / "new.json").write_text(json.dumps(summary(50.0, 4, verify=2.5)))
    fp32 = summary(50.0, 2, paired=False, ar=1.0, verify=2.4)
    (runs / "new-fp32.json").write_text(json.dumps(fp32))
    (runs / "new-fp32.samples.jsonl").write_text("".join(
        json.dumps({"mode": m, "id": f"T/{i}", "passed": True, "reply": "same" if i == 0 or m == "ar" else "other"})
        + "\n" for m in ("ar", "verify") for i in range(2)))
    b1 = summary(50.0, 2, paired=False, ar=1.0, **{"verify": 2.0})
    b1["verify"]["positions_per_forward"], b1["verify"]["speedup_vs_ar"] = 3.0, 1.5
    (runs / "new-b1.json").write_text(json.dumps(b1))
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"models": {"m": {"bfloat16": {"1": {"n": [1, 2, 4], "seconds": [1.0, 1.0, 2.0]}}}}}))
    out = tmp_path / "results" / "real"
    real_report.main(["--runs", str(runs), "--arms", "new", "--keep", str(keep), "--out", str(out),
                      "--cost", str(cost), "--cost-model", "m"])
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["arms"]) == {"old", "new"}
    old = report["arms"]["old"]["modes"]
    assert old["0.9"]["rule"] == "raw" and old["0.9"]["tau"] == 0.9
    assert report["arms"]["old"]["modes"]["verify-tree"] == {"accuracy": 50.0, "tokens_per_forward": 2.3,
                                                             "rule": "exact", "layout": "tree", "budget": 0}
    new = report["arms"]["new"]
    assert new["modes"]["verify"]["rule"] == "exact" and new["modes"]["verify"]["budget"] >= 1
    assert new["float32"]["verify"]["identical_to_base"] == 1  # one of two replies equals the adapter's own ar
    # t(3) = 1.5 t(1) on this curve, so 2.0 tokens per forward can give at most 2.0 / 1.5 times AR.
    assert abs(new["batch1"]["verify"]["limit_vs_ar"] - 2.0 / 1.5) < 1e-9


def test_knob_report_names_each_rule_and_its_repeat_rates(tmp_path):
    from tools import knob_report

    def st(acc, tpf):
        return {"accuracy": acc, "problems": 10, "tokens_per_forward": tpf, "slot_accepts": [10, 8, 4, 2],
                "slot_repeats": [0, 2, 1, 1]}

    a = {"0.9": st(40, 1.5), "0.7": st(30, 1.8), "cal-0.9": st(50, 1.4), "settings": {}}
    b = {"verify": {**st(55, 2.3), "paired_vs_baseline": {"difference": 0.6, "difference_se": 0.6,
                                                           "identical_replies": 0.85}}, "tol-0.5": st(54, 2.4)}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    knob_report.main(["--runs", f"m={tmp_path / 'a.json'},{tmp_path / 'b.json'}", "--out", str(tmp_path / "knob")])
    rows = json.loads((tmp_path / "knob.json").read_text())["models"]["m"]
    assert [(r["mode"], r["rule"]) for r in rows] == [("verify", "exact"), ("0.9", "raw"), ("0.7", "raw"),
                                                      ("cal-0.9", "calibrated"), ("tol-0.5", "base-checked")]
    assert rows[1]["tau"] == 0.9 and rows[-1]["tolerance"] == 0.5 and rows[0]["vs_baseline"] == 0.6
    assert rows[0]["repeat_rate_per_slot"] == [0.0, 0.25, 0.25, 0.5]
    assert (tmp_path / "knob.png").stat().st_size > 1000
    knob_report.main(["--runs", f"m={tmp_path / 'a.json'}", "--out", str(tmp_path / "knob-0.5b")])  # a dot in the name
    assert (tmp_path / "knob-0.5b.json").is_file() and (tmp_path / "knob-0.5b.png").is_file()

    # --keep: the earlier report's models stay, a model given again is replaced by its new rows
    (tmp_path / "c.json").write_text(json.dumps({"0.8": st(20, 2.0)}))
    knob_report.main(["--keep", str(tmp_path / "knob.json"), "--runs", f"n={tmp_path / 'c.json'}",
                      "--out", str(tmp_path / "both")])
    both = json.loads((tmp_path / "both.json").read_text())["models"]
    assert both["m"] == json.loads((tmp_path / "knob.json").read_text())["models"]["m"]
    assert [r["mode"] for r in both["n"]] == ["0.8"]
    knob_report.main(["--keep", str(tmp_path / "both.json"), "--runs", f"m={tmp_path / 'c.json'}",
                      "--out", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again.json").read_text())["models"]
    assert [r["mode"] for r in again["m"]] == ["0.8"] and list(again) == ["m", "n"]
    knob_report.main(["--keep", str(tmp_path / "again.json"), "--out", str(tmp_path / "replot")])  # --keep alone
    assert json.loads((tmp_path / "replot.json").read_text())["models"] == again


def test_an_arms_further_runs_join_its_modes_and_samples(tmp_path):
    # --arms NAME=SUMMARY: the speed knob's run on the same adapter adds its modes and replies to NAME's.
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "base.json").write_text(json.dumps(summary(50.0, 4, paired=False)))
    (runs / "ad.json").write_text(json.dumps(summary(50.0, 4, verify=2.5)))
    knob = summary(25.0, 4, **{"cal-0.9": 1.7})
    knob["settings"] = {"ckpt": "knob"}
    (tmp_path / "knob-0.9").write_text(json.dumps(knob))  # eval.py --out knob-0.9: its samples, knob-0.9.samples.jsonl
    for path, mode in ((runs / "ad.samples.jsonl", "verify"), (tmp_path / "knob-0.9.samples.jsonl", "cal-0.9")):
        path.write_text(json.dumps({"mode": mode, "id": "T/0", "passed": True, "reply": mode}) + "\n")
    out = tmp_path / "results" / "real"
    real_report.main(["--runs", str(runs), "--arms", f"ad={tmp_path / 'knob-0.9'}", "--out", str(out),
                      "--old", f"none={tmp_path / 'none.json'}"])
    ad = json.loads(out.with_suffix(".json").read_text())["arms"]["ad"]
    assert list(ad["modes"]) == ["verify", "cal-0.9"] and ad["modes"]["cal-0.9"]["rule"] == "calibrated"
    assert ad["modes"]["cal-0.9"]["accuracy"] == 25.0 and ad["eval_settings"] == {"ckpt": "x"}  # NAME.json's own
    lines = (tmp_path / "results" / "real_samples" / "ad.jsonl").read_text().splitlines()
    assert [json.loads(line)["mode"] for line in lines] == ["verify", "cal-0.9"]
