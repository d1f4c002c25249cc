# The README's file tree is a map a reader trusts: it lists every library file, script and tool that
# exists, and nothing that does not.
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_tree() -> set[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Files", 1)[1].split("```")[1]
    return {m[1] for m in re.finditer(r"^(\S+\.py)\s", block, re.M)}


def test_readme_file_tree_lists_exactly_the_files_that_exist():
    tree = readme_tree()
    code = {p.name for p in ROOT.glob("*.py")} | {f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py")}
    code -= {"tools/__init__.py"}
    missing, gone = sorted(code - tree), sorted(tree - code)
    assert not missing, f"README.md, ## Files: add {', '.join(missing)}"
    assert not gone, f"README.md, ## Files: {', '.join(gone)} no longer exist; remove them"
