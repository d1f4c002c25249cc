# The README's file tree is a map a reader trusts: every script and tool is on it, with its true
# line count.
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_tree() -> dict[str, int]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Files", 1)[1].split("```")[1]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+)\s+(\d+)  ", block, re.M)}


def lines(path: Path) -> int:
    files = sorted(path.glob("*.py")) if path.is_dir() else [path]
    return sum(len(f.read_text().splitlines()) for f in files)


def test_readme_file_tree_is_complete_and_its_counts_are_true():
    tree = readme_tree()
    code = {p.name for p in ROOT.glob("*.py")} | {f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py")}
    missing = sorted(code - {"tools/__init__.py"} - set(tree))
    assert not missing, f"README.md, ## Files: add {', '.join(missing)}"
    wrong = {name: (n, lines(ROOT / name)) for name, n in tree.items() if lines(ROOT / name) != n}
    assert not wrong, "README.md, ## Files: " + "; ".join(
        f"{name} says {n} lines, has {true}" for name, (n, true) in wrong.items())


def test_readme_stays_a_map():
    # The details live in docs/; the README is what a newcomer reads first.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
