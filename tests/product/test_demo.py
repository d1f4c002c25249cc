# The newcomer's path: `make quickstart` (tools/demo.py --quick) runs the demo's whole pipeline and writes
# every file under runs/quickstart and data/quickstart, never over the full run's tracked results/demo.json
# and results/demo.png; its training stages print one progress line each and the settings once.
import json
import subprocess
from pathlib import Path

import pytest

import train
from tools import demo

ROOT = Path(__file__).resolve().parents[2]


def test_quick_keeps_clear_of_the_tracked_results():
    tracked = set(subprocess.run(["git", "ls-files", "results", "data", "runs"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.split())
    assert {"results/demo.json", "results/demo.png"} <= tracked  # what the README shows
    s = demo.parse_settings(["--quick"])
    written = [Path(s.results) / "demo.json", Path(s.results) / "demo.png", Path(s.data) / "train.jsonl",
               Path(s.out) / "mars"]
    assert all(p.parts[0] in ("runs", "data") and p.parts[1] == "quickstart" for p in written)
    assert not {str(p) for p in written} & tracked
    full = demo.parse_settings([])
    assert (full.results, full.out, full.data) == ("results", "runs/demo", "data/demo")
    assert demo.parse_settings(["--quick", "--results", "elsewhere"]).results == "elsewhere"  # a flag still wins


def test_quick_stages_train_under_runs_quickstart_with_a_line_each(tmp_path, monkeypatch, capsys):
    # The stages as train.py is called for them (the training itself: tests/spec/test_train.py), in an empty
    # folder: data under data/quickstart, checkpoints under runs/quickstart, each stage --quiet (no
    # settings of its own) and one kept step line (--log-every its steps); the demo's settings once.
    class Stop(Exception):
        pass

    calls = []

    def train_main(argv):
        calls.append(argv)
        if len(calls) == 3:
            raise Stop

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo.train, "main", train_main)
    with pytest.raises(Stop):
        demo.main(["--quick", "--n-train", "48", "--n-test", "3"])
    out = capsys.readouterr().out
    assert (tmp_path / "data/quickstart/train.jsonl").is_file() and not (tmp_path / "data/demo").exists()
    stages = [train.parse_settings(argv) for argv in calls]
    assert [t.out for t in stages] == ["runs/quickstart/ar", "runs/quickstart/mars", "runs/quickstart/ar2"]
    assert all(t.data == "data/quickstart/train.jsonl" and t.log_every == t.max_steps == 800 and t.quiet
               for t in stages)
    assert out.count("demo settings:") == 1
    assert [line for line in out.splitlines() if line.startswith("==== stage")] == [
        "==== stage 1 of 3: AR SFT ====", "==== stage 2 of 3: MARS from stage 1 ====",
        "==== stage 3 of 3, the control: stage 1 continued as AR SFT, as many steps as stage 2 ===="]


def test_piped_the_demo_says_what_it_does_and_ends_with_what_to_try(tmp_path, monkeypatch, capsys):
    # capsys is no terminal, as `make quickstart | tee` is not: each stage's step line, each evaluation and
    # each round of timing print a line as they end. The table's speed-ups, from a single timing under
    # --quick, say that they are noise; the last lines are commands to try on the demo's own files, and
    # they run as printed.
    import shlex

    import generate
    from mars import cli, serve
    from mars import eval as evaluation

    monkeypatch.chdir(tmp_path)
    demo.main(["--quick", "--n-train", "96", "--n-test", "2", "--steps", "2", "--speed-prompts", "1",
               "--thresholds", "1.0", "0.9", "--max-new-tokens", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("step 2/2 |") for line in lines) == 3
    for name in ("AR SFT", "AR SFT, 2x steps", "MARS tau 1.0", "MARS tau 0.9", "MARS verify, tree",
                 "MARS verify, chain"):
        assert any(line.startswith(f"  {name}: accuracy ") for line in lines), name
    assert [line.split(":")[0] for line in lines if line.startswith("  speed,")] == [
        "  speed, round 1/1, batch 1", "  speed, round 1/1, batch 8"]
    assert any(line.startswith("caveat: these speed-ups come from a single timing") and "`make demo`" in line
               for line in lines)
    header = lines.index("per family (AR SFT | AR SFT 2x steps | MARS tau=1.0 | MARS tau=0.9):")
    assert lines[header + 1].count("|") == 3  # a column per name
    prompt = json.loads((tmp_path / "data/quickstart/test.jsonl").read_text().splitlines()[0])["messages"][0]["content"]
    assert lines[-4:] == [
        "next, try the MARS model yourself:",
        f"  python generate.py --ckpt runs/quickstart/mars --prompt {shlex.quote(prompt)} --threshold 0.9",
        "  python serve.py --ckpt runs/quickstart/mars",
        "  python eval.py --ckpt runs/quickstart/mars --task demo --data data/quickstart/test.jsonl --modes ar 0.9 "
        "verify"]
    generate.main(shlex.split(lines[-3])[2:] + ["--max-new-tokens", "4", "--device", "cpu"])
    cli.parse(serve.Settings, shlex.split(lines[-2])[2:], "")
    evaluation.main(shlex.split(lines[-1])[2:] + ["--max-new-tokens", "4", "--device", "cpu"])
    assert "verify: accuracy" in capsys.readouterr().out


def test_bad_flags_and_paths_are_usage_errors_before_any_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for flags, message in ((["--n-test", "0"], "--n-test 0 must be at least 1"),
                           (["--speed-reps", "0"], "--speed-reps 0 must be at least 1"),
                           (["--thresholds", "1.5"], "--thresholds 1.5: taus in [0, 1]"),
                           (["--results", str(tmp_path / "file")], "the demo writes a folder there")):
        with pytest.raises(SystemExit) as e:
            demo.main(["--quick", *flags])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_long_work_prints_a_line_at_least_every_30_seconds(capsys):
    now = [0.0]
    say = demo.Progress(now=lambda: now[0])
    for i in range(1, 13):  # 10 s a batch: a line when 30 s have passed since the last one
        now[0] += 10.0
        say(f"{i}/12 prompts", always=False)
    say("done")
    assert capsys.readouterr().out.splitlines() == ["3/12 prompts", "6/12 prompts", "9/12 prompts", "12/12 prompts",
                                                    "done"]
