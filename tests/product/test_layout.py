# The layout is a stack: library files (model.py, data.py, checkpoint.py, verify.py, http_server.py,
# distributed.py, loss.py, keep_base.py, ...), then the scripts users run (train, generate, serve, eval),
# then tools/. A file imports only from its own level or below, and the imports have no cycle, so every
# module can be read after the ones it uses.
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train", "generate", "serve", "eval")


def modules() -> dict[str, Path]:
    top = {p.stem: p for p in ROOT.glob("*.py")}
    return top | {f"tools.{p.stem}": p for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__"}


def imports(file: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & known


def level(name: str) -> int:
    return 2 if name.startswith("tools.") else 1 if name in SCRIPTS else 0


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(file, set(mods)) - {name} for name, file in mods.items()}


def test_no_module_imports_one_above_it():
    up = [f"{m} imports {d}" for m, deps in graph().items() for d in deps if level(d) > level(m)]
    assert not up, up


def test_the_imports_have_no_cycle():
    g, done, path = graph(), set(), []

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
    # The graph is not empty by accident: known edges are found, at every level.
    g = graph()
    assert {"files", "model"} <= g["checkpoint"] and {"checkpoint", "verify"} <= g["generate"]
    assert {"generate", "http_server"} <= g["serve"] and "tools.bench" in g["tools.bench_serve"]
    assert level("model") == 0 and level("verify") == 0 and level("http_server") == 0
    assert level("eval") == 1 and level("tools.demo") == 2
    assert not g["http_server"]  # the HTTP layer stands on the standard library alone
    assert {"checkpoint", "distributed", "keep_base", "train_settings"} <= g["train"]
    assert "distributed" in g["checkpoint"] and "loss" in g["keep_base"]
    assert level("distributed") == level("loss") == level("keep_base") == level("train_settings") == 0
