"""Synthetic chat tasks for the CPU demo, and the checker that scores a model's answer.

Each answer mixes predictable stretches (fixed phrasing, the question restated, the result copied
into a closing "The answer is X.") with a few hard tokens (the results). That gives MARS's
confidence threshold tau something to trade: easy stretches can be accepted several tokens per
forward, the results mostly cannot. Everything is small (1-2 digit numbers, short fixed word
lists, lists of 3-6) so a ~1-5M parameter byte-level model learns it in a few thousand steps.

    python -m mars.tasks --out data/demo --n-train 20000 --n-test 500 --seed 0
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from mars import cli

WORDS = (
    "ant", "bag", "bed", "bee", "box", "bus", "cake", "car", "cat", "cow",
    "cup", "desk", "dog", "door", "duck", "egg", "fan", "fish", "frog", "hat",
    "ink", "jam", "key", "kite", "lamp", "leaf", "lion", "map", "milk", "moon",
    "nest", "net", "owl", "pen", "pig", "rain", "ring", "rose", "sea", "ship",
    "sock", "star", "sun", "tea", "tent", "tree", "van", "wolf", "yak", "zoo",
)  # fmt: skip
NAMES = (
    "Ana", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ida", "Jon",
    "Kai", "Lena", "Max", "Nora", "Omar", "Pia", "Raj", "Sara", "Tom", "Zoe",
)  # fmt: skip
CITIES = (
    "Oslo", "Rome", "Paris", "Lima", "Cairo", "Tokyo", "Berlin", "Madrid", "Dublin", "Vienna",
    "Prague", "Seoul", "Quito", "Delhi", "Accra", "Lagos", "Riga", "Bern", "Kyiv", "Hanoi",
)  # fmt: skip
# (from, to, factor, largest value). Integer factors only. Powers of ten just append zeros, so
# they take values up to 99; 60, 24 and 7 stop at 12 so the product is a times-table fact.
UNITS = (
    ("km", "m", 1000, 99), ("m", "cm", 100, 99), ("cm", "mm", 10, 99), ("kg", "g", 1000, 99),
    ("L", "mL", 1000, 99), ("dollars", "cents", 100, 99), ("hours", "minutes", 60, 12),
    ("minutes", "seconds", 60, 12), ("days", "hours", 24, 12), ("weeks", "days", 7, 12),
)  # fmt: skip
# Every (unit, value) question equally likely. Picking the unit first would put 40% of the draws
# on the 48 small-factor questions; the test split would use up half of them, and deduping
# would then strip those from train.
CONVERSIONS = tuple((src, dst, factor, v) for src, dst, factor, top in UNITS for v in range(1, top + 1))
MARK = "The answer is "  # every family but record closes with MARK + answer + "."


def pseudo_word(rng: random.Random) -> str:
    # Made-up words (2-3 consonant-vowel syllables) for the letter tasks, not WORDS: the test split
    # would use up all 50 real words and deduping would then strip them from train. It also makes
    # the model learn the procedure instead of memorising 50 spellings.
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3)))


# Each family returns (question, answer text, checked answer).
def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    form = rng.choice(("add", "sub", "add_mul", "mul_add"))
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    if form == "add":
        expr, steps, r = f"{a} + {b}", [f"{a} + {b} = {a + b}"], a + b
    elif form == "sub":
        a, b = max(a, b), min(a, b)  # no negative results: one less thing for a tiny model
        expr, steps, r = f"{a} - {b}", [f"{a} - {b} = {a - b}"], a - b
    elif form == "add_mul":
        a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(2, 9)
        expr, r = f"({a} + {b}) * {c}", (a + b) * c
        steps = [f"{a} + {b} = {a + b}", f"{a + b} * {c} = {r}"]
    else:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
        expr, r = f"{a} * {b} + {c}", a * b + c
        steps = [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {r}"]
    return f"What is {expr}?", ". ".join(steps) + f". {MARK}{r}.", str(r)


def sort(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(3, 6)
    if rng.random() < 0.5:
        kind, items = "numbers", [str(x) for x in rng.sample(range(1, 100), n)]
        out = sorted(items, key=int)
    else:
        kind, items = "words", rng.sample(WORDS, n)
        out = sorted(items)
    listed = ", ".join(out)
    return f"Sort these {kind}: {', '.join(items)}.", f"In order: {listed}. {MARK}{listed}.", listed


def reverse(rng: random.Random) -> tuple[str, str, str]:
    w = pseudo_word(rng)
    a = f"{w} is spelled {'-'.join(w)}. Backwards: {'-'.join(w[::-1])}. {MARK}{w[::-1]}."
    return f"Reverse the word {w}.", a, w[::-1]


def count(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.5:
        w = pseudo_word(rng)
        # Mostly a letter of the word; sometimes any letter, so "none" (0) also occurs.
        letter = rng.choice(w) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
        hits = [c for c in w if c == letter]
        q = f"How many times does the letter {letter} appear in {w}?"
        a = f"{w} is spelled {'-'.join(w)}. Matches: {', '.join(hits) or 'none'}. {MARK}{len(hits)}."
        return q, a, str(len(hits))
    items = rng.sample(WORDS, rng.randint(3, 6))
    tally = ", ".join(f"{w} {i}" for i, w in enumerate(items, 1))
    q = f"How many words are in this list: {', '.join(items)}?"
    return q, f"Counting: {tally}. {MARK}{len(items)}.", str(len(items))


def convert(rng: random.Random) -> tuple[str, str, str]:
    src, dst, factor, v = rng.choice(CONVERSIONS)
    a = f"{v} {src} = {v} * {factor} {dst} = {v * factor} {dst}. {MARK}{v * factor}."
    return f"Convert {v} {src} to {dst}.", a, str(v * factor)


def record(rng: random.Random) -> tuple[str, str, str]:
    rec = [("name", rng.choice(NAMES)), ("age", str(rng.randint(18, 90))), ("city", rng.choice(CITIES))]
    asked = rng.sample(rec, len(rec))  # shuffled in the question so the model reorders, not copies
    a = "\n".join(f"{k.capitalize()}: {v}" for k, v in rec)
    return "Make a record for " + ", ".join(f"{k} {v}" for k, v in asked) + ".", a, a


GENERATORS = {f.__name__: f for f in (arithmetic, sort, reverse, count, convert, record)}
FAMILIES: tuple[str, ...] = tuple(GENERATORS)


def make_example(family: str, rng: random.Random) -> dict:
    if family not in GENERATORS:
        raise ValueError(f"unknown task family {family!r}; choose one of {FAMILIES}")
    q, a, answer = GENERATORS[family](rng)
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages, "family": family, "answer": answer}


def make_split(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)  # round-robin keeps the families balanced in any prefix
    return [make_example(FAMILIES[i % len(FAMILIES)], rng) for i in range(n)]


def extract_answer(family: str, text: str) -> str | None:
    if family == "record":  # the whole record is the answer
        return text.strip() or None
    i = text.rfind(MARK)
    if i < 0:
        return None
    # Anything after the closing sentence stays in the answer, so trailing junk scores as wrong.
    return text[i + len(MARK) :].strip().removesuffix(".").strip()


def is_correct(example: dict, generated_text: str) -> bool:
    got = extract_answer(example["family"], generated_text)
    return got is not None and got == example["answer"].strip()


def write_splits(
    out_dir: str | Path, n_train: int, n_test: int, seed: int
) -> tuple[list[dict], list[dict], int]:
    # One seed per split, so changing n_test does not reshuffle train (and vice versa).
    test = make_split(n_test, 2 * seed + 1)
    held_out = {ex["messages"][0]["content"] for ex in test}
    generated = make_split(n_train, 2 * seed)
    train = [ex for ex in generated if ex["messages"][0]["content"] not in held_out]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in rows))
    return train, test, len(generated) - len(train)


@dataclass
class Settings:
    out: str = "data/demo"  # folder that receives train.jsonl and test.jsonl
    n_train: int = 20000  # train examples generated, before dropping those whose prompt is in test
    n_test: int = 500  # test examples, round-robin over FAMILIES
    seed: int = 0  # same seed, byte-identical files


def mean_bytes(rows: list[dict], turn: int) -> float:
    return sum(len(ex["messages"][turn]["content"].encode()) for ex in rows) / max(len(rows), 1)


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Write synthetic chat tasks as train/test JSONL.")
    print(asdict(s))
    train, test, removed = write_splits(s.out, s.n_train, s.n_test, s.seed)
    print(f"removed {removed} train examples whose prompt is also in test")
    for name, rows in (("train", train), ("test", test)):
        print(f"{Path(s.out) / name}.jsonl: {len(rows)} examples")
        print(f"  {'family':<11} {'count':>6} {'prompt B':>9} {'answer B':>9}")
        for fam in FAMILIES + ("all",):
            sel = [ex for ex in rows if fam in (ex["family"], "all")]
            print(f"  {fam:<11} {len(sel):>6} {mean_bytes(sel, 0):>9.1f} {mean_bytes(sel, 1):>9.1f}")


if __name__ == "__main__":
    main()
