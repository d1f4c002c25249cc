# Every section the code and the docs cite resolves inside the repository: `docs/method.md §N` names a
# heading "## N." of docs/method.md, every docs/*.md file named exists, and nothing cites a spec file
# that a clone does not have.
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tracked() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not names:  # not a git checkout (an unpacked archive): every text file
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".venv" not in p.parts]
    return {n: (ROOT / n).read_text(encoding="utf-8") for n in names
            if n.endswith((".py", ".md", ".toml", "Makefile")) and (ROOT / n).is_file()}


def sections() -> set[int]:
    text = (ROOT / "docs" / "method.md").read_text(encoding="utf-8")
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.M)}


def cited(text: str) -> list[int]:
    # "docs/method.md §9", "§1-5" (a range), "§6, §7, §9" (a list)
    out = []
    for m in re.finditer(r"docs/method\.md ((?:§\d+(?:-\d+)?(?:, )?)+)", text):
        for a, b in re.findall(r"§(\d+)(?:-(\d+))?", m.group(1)):
            out += range(int(a), int(b or a) + 1)
    return out


def cited_bare(text: str) -> list[int]:
    # In code a bare "§9" (or "§1-5") is docs/method.md's section: the one spec a comment may cite.
    return [n for a, b in re.findall(r"§(\d+)(?:-(\d+))?", text) for n in range(int(a), int(b or a) + 1)]


def test_cited_sections_exist():
    have = sections()
    assert have == set(range(1, len(have) + 1))  # numbered 1..N with no gap
    missing = [(name, n) for name, text in tracked().items()
               for n in (cited_bare(text) if name.endswith(".py") else cited(text)) if n not in have]
    assert not missing


def test_cited_files_exist_and_no_outside_spec_is_cited():
    for name, text in tracked().items():
        for doc in re.findall(r"\bdocs/[\w-]+\.md", text):
            assert (ROOT / doc).is_file(), (name, doc)
        assert not re.search(r"\b(MARS|QWEN2|STYLE)\.md", text), name


def test_the_citation_parser():
    assert cited("see docs/method.md §6, §7, §9 and docs/method.md §1-3.") == [6, 7, 9, 1, 2, 3]
    assert cited_bare("the cache (§7), the rule (§6, §9) and §1-3") == [7, 6, 9, 1, 2, 3]
    assert 99 not in sections() and cited_bare("# §" + "99") == [99]  # one the test would catch
