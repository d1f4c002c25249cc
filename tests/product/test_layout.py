# The layout is the card: five method files at the root (model, data, train, generate, kvcache) and the
# commands a user types (serve.py, eval.py), the product in mars/, benchmarks and checks in tools/. The
# method files import the package lightly at module level (optional features load where they are used),
# the package never imports tools, tests/spec reads the method alone, and the imports have no cycle.
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = {"model", "data", "train", "generate", "kvcache"}
ENTRY = {"serve", "eval"}
# what tests/spec may read besides CORE: self-verification and the layout of a step's inputs (§9), the adapter
METHOD_MODULES = {"mars.verify", "mars.layout", "mars.adapter", "mars.tokenizer"}
MAX_PACKAGE_IMPORTS = 4  # a core file's module-level imports of the package


def modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for d in ("mars", "tools"):
        found |= {f"{d}.{p.stem}": p for p in (ROOT / d).glob("*.py") if p.stem != "__init__"}
    return found


def imports(file: Path, top_level_only: bool = False) -> set[str]:
    # Every module named by an import in the file (`from mars import x` names mars.x); with top_level_only,
    # only the statements at module level, which run when the file is imported.
    tree = ast.parse(file.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & (set(modules()) | {"mars"})


def test_the_root_is_the_method_and_two_commands():
    assert {p.stem for p in ROOT.glob("*.py")} == CORE | ENTRY


def test_core_files_import_little_of_the_package_at_module_level():
    for name in CORE:
        local = imports(ROOT / f"{name}.py", top_level_only=True)
        package = {m for m in local if m.startswith("mars.")}
        assert len(package) <= MAX_PACKAGE_IMPORTS, f"{name}.py imports {sorted(package)} at module level"
        assert not {m for m in local if m.startswith("tools.")} and not local & ENTRY, f"{name}.py: {local}"
    assert not imports(ROOT / "model.py", top_level_only=True) - {"mars", "mars.files"}
    assert imports(ROOT / "kvcache.py") <= {"model"}


def test_the_package_never_imports_tools_or_the_commands():
    for name, file in modules().items():
        if name.startswith("mars."):
            bad = {m for m in imports(file) if m.startswith("tools.") or m in ENTRY}
            assert not bad, f"{file.name} imports {sorted(bad)}"


def test_the_spec_reads_the_method_alone():
    for file in sorted((ROOT / "tests" / "spec").glob("*.py")):
        other = {m for m in imports(file) if m not in CORE and m != "mars" and m not in METHOD_MODULES}
        assert not other, f"tests/spec/{file.name} imports {sorted(other)}: move that test to tests/product"


def test_the_imports_have_no_cycle():
    # Module-level imports only: those run when a module is imported, and a cycle among them is what Python
    # cannot load. An import inside a function runs when it is called, after every module has loaded: that
    # is how optional features load where they are used (generate.decode_step imports mars.verify, which
    # imports generate's rule).
    mods = modules()
    g = {name: {m for m in imports(file, top_level_only=True) if m in mods} - {name} for name, file in mods.items()}
    done, path = set(), []

    def visit(m: str) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m not in done:
            path.append(m)
            for d in sorted(g[m]):
                visit(d)
            path.pop()
            done.add(m)
    for m in sorted(g):
        visit(m)


def test_the_checker_sees_imports():
    # The checks are not empty by accident: known edges are found.
    assert {"mars.files", "model"} <= imports(ROOT / "mars" / "checkpoint.py")
    assert "kvcache" in imports(ROOT / "generate.py", top_level_only=True)
    assert "mars.serve" in imports(ROOT / "serve.py")


def test_results_hold_artifacts_not_scripts():
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*")
                     if p.suffix in (".py", ".sh") or (p.is_file() and p.stat().st_mode & 0o111))
    assert not scripts, f"results/ keeps artifacts only; these scripts belong in tools/ or in git history: {scripts}"
