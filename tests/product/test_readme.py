# The README's file tree is a map a reader trusts: it lists every method file, package module, script and tool that
# exists, every folder of tests, and nothing that does not.
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_tree() -> str:
    return (ROOT / "README.md").read_text().split("## Files", 1)[1].split("```")[1]


def test_readme_file_tree_lists_exactly_the_files_that_exist():
    tree = {m[1] for m in re.finditer(r"^(\S+\.py)\s", readme_tree(), re.M)}
    code = {p.name for p in ROOT.glob("*.py")} | {f"{d}/{p.name}" for d in ("mars", "tools")
                                                   for p in (ROOT / d).glob("*.py")}
    code -= {"mars/__init__.py", "tools/__init__.py"}
    missing, gone = sorted(code - tree), sorted(tree - code)
    assert not missing, f"README.md, ## Files: add {', '.join(missing)}"
    assert not gone, f"README.md, ## Files: {', '.join(gone)} no longer exist; remove them"


def test_readme_file_tree_lists_exactly_the_test_folders():
    tree = {m[1] for m in re.finditer(r"^(tests/\S+/)\s", readme_tree(), re.M)}
    folders = {f"tests/{p.name}/" for p in (ROOT / "tests").iterdir()
               if p.is_dir() and p.name not in ("__pycache__", ".pytest_cache")}
    assert tree == folders, f"README.md, ## Files: list {sorted(folders)}, not {sorted(tree)}"
    assert {"tests/spec/", "tests/product/"} <= tree
