# The core files (the repository root's *.py) read a function at a time: none is longer than 60 lines
# or takes more than 8 parameters. A main that only parses its flags and dispatches (no loop) may be
# longer.
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES, MAX_PARAMS = 60, 8


def has_loop(node: ast.AST) -> bool:
    loops = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    return any(isinstance(n, loops) for n in ast.walk(node))


def sizes() -> dict[str, tuple[int, int]]:
    # "file:function" -> (lines from def to the last line, parameters besides self and cls), for every
    # function and method, nested ones included.
    found = {}
    for file in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs] + [a.vararg, a.kwarg]
            params = sum(1 for p in names if p is not None and p not in ("self", "cls"))
            lines = node.end_lineno - node.lineno + 1
            if node.name == "main" and not has_loop(node):
                lines = 0  # parses and dispatches: its length is its flags
            found[f"{file.name}:{node.name}"] = max((lines, params), found.get(f"{file.name}:{node.name}", (0, 0)))
    return found


def over(size: tuple[int, int]) -> bool:
    return size[0] > MAX_LINES or size[1] > MAX_PARAMS


def test_no_core_function_is_over_the_limits():
    new = [f"{name} ({lines} lines, {params} parameters)" for name, (lines, params) in sizes().items()
           if over((lines, params))]
    assert not new, f"split these below {MAX_LINES} lines and {MAX_PARAMS} parameters: {', '.join(new)}"


def test_the_checker_measures():
    found = sizes()
    assert found["generate.py:decode_step"][1] == 8 and found["model.py:apply_rope"] == (4, 3)
    assert over((61, 1)) and over((10, 9)) and not over((60, 8))
    assert found["train.py:main"] == (0, 1)  # parses and dispatches
