# The newcomer's path: `make quickstart` (tools/demo.py --quick) runs the demo's whole pipeline and writes
# every file under runs/quickstart and data/quickstart, never over the full run's tracked results/demo.json
# and results/demo.png; its training stages print one progress line each and the settings once.
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
