import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mars import tasks

ROOT = Path(__file__).resolve().parents[2]


def user(ex: dict) -> str:
    return ex["messages"][0]["content"]


def reply(ex: dict) -> str:
    return ex["messages"][1]["content"]


def expected_answer(ex: dict) -> str:
    # Recompute each family's answer from the question alone, independently of mars/tasks.py.
    q = user(ex)
    if ex["family"] == "arithmetic":
        expr = re.fullmatch(r"What is ([\d+\-*() ]+)\?", q).group(1)
        return str(eval(expr))
    if ex["family"] == "sort":
        kind, items = re.fullmatch(r"Sort these (numbers|words): (.+)\.", q).groups()
        items = items.split(", ")
        return ", ".join(sorted(items, key=int) if kind == "numbers" else sorted(items))
    if ex["family"] == "reverse":
        return re.fullmatch(r"Reverse the word ([a-z]+)\.", q).group(1)[::-1]
    if ex["family"] == "count":
        if m := re.fullmatch(r"How many times does the letter ([a-z]) appear in ([a-z]+)\?", q):
            return str(m.group(2).count(m.group(1)))
        return str(len(re.fullmatch(r"How many words are in this list: (.+)\?", q).group(1).split(", ")))
    if ex["family"] == "convert":
        factor = {"km": 1000, "m": 100, "cm": 10, "kg": 1000, "L": 1000, "dollars": 100,
                  "hours": 60, "minutes": 60, "days": 24, "weeks": 7}  # fmt: skip
        v, unit = re.fullmatch(r"Convert (\d+) (\w+) to \w+\.", q).groups()
        return str(int(v) * factor[unit])
    assert ex["family"] == "record"
    fields = dict(re.findall(r"(name|age|city) (\w+)", q))
    return f"Name: {fields['name']}\nAge: {fields['age']}\nCity: {fields['city']}"


@pytest.fixture(scope="module")
def examples() -> list[dict]:
    return tasks.make_split(3000, seed=7)


def test_every_family_appears_balanced(examples):
    counts = {f: sum(ex["family"] == f for ex in examples) for f in tasks.FAMILIES}
    assert len(tasks.FAMILIES) >= 5
    assert all(c == len(examples) // len(tasks.FAMILIES) for c in counts.values()), counts


def test_reference_answers_are_right(examples):
    for ex in examples:
        assert ex["answer"] == expected_answer(ex), ex
        assert tasks.extract_answer(ex["family"], reply(ex)) == ex["answer"], ex
        assert tasks.is_correct(ex, reply(ex))
        assert tasks.is_correct(ex, "  " + reply(ex) + "\n")  # surrounding whitespace is ignored


def test_worked_arithmetic_steps_are_right(examples):
    for ex in examples:
        if ex["family"] == "arithmetic":
            steps = re.findall(r"(\d+) ([+\-*]) (\d+) = (\d+)", reply(ex))
            assert steps and all(eval(f"{a} {op} {b}") == int(r) for a, op, b, r in steps), ex


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_corrupted_answer_is_wrong(family):
    rng = random.Random(0)
    for _ in range(50):
        ex = tasks.make_example(family, rng)
        text = reply(ex)
        # Change one character of the checked answer (it sits just before the final "." or at the end).
        i = len(text) - 2
        corrupted = text[:i] + ("X" if text[i] != "X" else "Y") + text[i + 1 :]
        assert not tasks.is_correct(ex, corrupted), corrupted
        assert not tasks.is_correct(ex, text + " And more.")  # trailing junk counts as wrong
        assert not tasks.is_correct(ex, "")
    if family != "record":
        assert tasks.extract_answer(family, "I do not know.") is None


def test_unknown_family_raises():
    with pytest.raises(ValueError, match="unknown task family"):
        tasks.make_example("poetry", random.Random(0))


def test_lengths_are_bounded(examples):
    for ex in examples:
        q, a = len(user(ex).encode()), len(reply(ex).encode())
        assert q + a < 200 and 10 <= a <= 120, ex


def test_same_seed_same_files_different_seed_different(tmp_path):
    tasks.write_splits(tmp_path / "a", 600, 60, seed=1)
    tasks.write_splits(tmp_path / "b", 600, 60, seed=1)
    tasks.write_splits(tmp_path / "c", 600, 60, seed=2)
    for name in ("train.jsonl", "test.jsonl"):
        a, b, c = ((tmp_path / d / name).read_bytes() for d in "abc")
        assert a == b and a != c


def test_test_prompts_are_not_in_train(tmp_path):
    train, test, removed = tasks.write_splits(tmp_path, 3000, 300, seed=0)
    assert removed > 0  # the small convert space guarantees some overlap to remove
    assert len(train) == 3000 - removed and len(test) == 300
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert rows == train
    assert not {user(ex) for ex in train} & {user(ex) for ex in test}


def test_cli_writes_the_same_files_as_the_api(tmp_path):
    # A separate process has a different hash seed, so this also pins that nothing depends on it.
    out = tmp_path / "cli"
    flags = ["--out", str(out), "--n-train", "600", "--n-test", "60", "--seed", "3"]
    cmd = [sys.executable, "-m", "mars.tasks", *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    assert "removed" in run.stdout and all(f in run.stdout for f in tasks.FAMILIES)
    tasks.write_splits(tmp_path / "api", 600, 60, seed=3)
    for name in ("train.jsonl", "test.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "api" / name).read_bytes()
