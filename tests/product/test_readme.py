# The README's file tree is a map a reader trusts: it lists every method file, package module, script and tool that
# exists, every folder of tests, and nothing that does not.
import ast
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_tree() -> str:
    return (ROOT / "README.md").read_text().split("## Files", 1)[1].split("```")[1]


def test_readme_file_tree_lists_exactly_the_files_that_exist():
    tree = {m[1] for m in re.finditer(r"^(\S+\.(?:py|cpp))\s", readme_tree(), re.M)}
    code = {p.name for p in ROOT.glob("*.py")} | {f"{d}/{p.name}" for d in ("mars", "tools")
                                                   for p in (ROOT / d).glob("*.py")} \
        | {f"mars/{p.name}" for p in (ROOT / "mars").glob("*.cpp")}
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


# Every command the README shows runs as written: each `python X.py` / `python -m tools.X` names a script that
# exists and passes only flags of its Settings dataclass (mars/cli.py turns field f into --f, and a bool into
# --f / --no-f too), each `make X` names a Makefile target. Read from the source, so no command is started.
# A root command and the module that holds its Settings.
COMMANDS = {"serve.py": "mars.serve", "eval.py": "mars.eval", "generate.py": "mars.prompts"}
FOREIGN_FLAGS = {"tools.lm_eval_mars"}  # lm-eval's own CLI takes the flags
COMMAND = re.compile(r"\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:python3?|torchrun|make)\s")  # a line this test reads
REMOVED = re.compile(r"--(calibration|calibrate|teacher|mask-embed)\b")  # flags of features taken out (method §16)


def settings_fields(module: str) -> dict[str, str]:
    # {field: its annotation} of `module`'s Settings, following a `from M import Settings` to M.
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Settings":
            return {n.target.id: ast.unparse(n.annotation) for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "Settings" and a.asname in (None, "Settings")
                                                    for a in node.names):
            return settings_fields(node.module)
    raise LookupError(f"{module} has no Settings")


def flags_of(module: str) -> set[str]:
    out = {"--help"}
    for name, annotation in settings_fields(module).items():
        flag = "--" + name.replace("_", "-")
        out |= {flag, "--no-" + flag[2:]} if annotation.strip("'\"") == "bool" else {flag}
    return out


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def readme_commands(text: str) -> list[str]:
    # The command lines of the code blocks (continuation lines joined), then the inline `python ...` and
    # `make ...` spans of the prose.
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    spans = [" ".join(s.split()) for s in re.findall(r"`((?:python|make|torchrun) [^`]+)`", prose)]
    return [c for c in lines + spans if COMMAND.match(c)]


def command_errors(command: str, targets: set[str]) -> list[str]:
    errors = []
    try:
        words = shlex.split(command, comments=True)
    except ValueError as e:
        return [f"{command!r}: {e}"]
    segments, current = [], []
    for w in words:
        if w in ("&&", "||", ";", "|"):
            segments, current = segments + [current], []
        else:
            current.append(w)
    for seg in segments + [current]:
        while seg and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", seg[0]):  # VAR=value before the command
            seg = seg[1:]
        if not seg:
            continue
        script, args = None, []
        if seg[0] in ("python", "python3") and len(seg) > 1:
            if seg[1] == "-m" and len(seg) > 2 and seg[2].split(".")[0] in ("tools", "mars"):
                script, args = seg[2], seg[3:]
                if not (ROOT / (script.replace(".", "/") + ".py")).is_file():
                    errors.append(f"{command!r}: no module {script}")
                    continue
            elif seg[1].endswith(".py"):
                script, args = seg[1], seg[2:]
        elif seg[0] == "torchrun":
            at = next((i for i, w in enumerate(seg) if w.endswith(".py")), None)
            if at is not None:
                script, args = seg[at], seg[at + 1:]
        elif seg[0] == "make":
            errors += [f"{command!r}: no Makefile target {t}" for t in seg[1:]
                       if not t.startswith("-") and "=" not in t and t not in targets]
        if script is None:
            continue
        if script.endswith(".py"):
            if not (ROOT / script).is_file():
                errors.append(f"{command!r}: no script {script}")
                continue
            module = COMMANDS.get(script, script[:-3])
        else:
            module = script
        if module in FOREIGN_FLAGS:
            continue
        known = flags_of(module)
        errors += [f"{command!r}: {script} has no flag {f}" for f in (a.split("=")[0] for a in args)
                   if f.startswith("--") and f not in known]
    return errors


def test_readme_commands_name_real_scripts_flags_and_targets():
    text = (ROOT / "README.md").read_text()
    commands, targets = readme_commands(text), make_targets()
    ran = " ".join(commands)
    for needed in ("python train.py", "python generate.py", "python serve.py", "python eval.py", "python -m tools.",
                   "torchrun", "make quickstart", "make demo", "make test"):
        assert needed in ran, f"README.md: no `{needed} ...` command found; the reader below misses it"
    errors = [e for c in commands for e in command_errors(c, targets)]
    assert not errors, "README.md: fix these commands:\n" + "\n".join(errors)
    removed = sorted(set(REMOVED.findall(text)))
    assert not removed, f"README.md: --{', --'.join(removed)} belong to removed features (docs/method.md §16)"


def test_the_command_reader_catches_a_bad_command():
    targets = make_targets()
    assert not command_errors("python train.py --init tiny --no-prune --adapter gated-lora --out runs/x", targets)
    assert not command_errors("MARS_API_KEY=k python serve.py --ckpt D --tau-min 1.0  # a comment", targets)
    assert command_errors("python train.py --init tiny --no-such-flag 1", targets)
    assert command_errors("python train.py --no-init x", targets)  # --no- exists only for bools
    assert command_errors("python eval.py --ckpt D --threshold 0.9", targets)  # generate.py's flag, not eval's
    assert command_errors("torchrun --nproc_per_node 2 train.py --teachr init", targets)
    assert command_errors("python -m tools.nope --x 1", targets) and command_errors("python nope.py", targets)
    assert command_errors("make quickstrat", targets) and not command_errors("make demo VLLM_BASE=x", targets)
    assert not command_errors("python -m tools.lm_eval_mars --model mars --tasks gsm8k_cot", targets)
    assert readme_commands("x `python eval.py\n--ckpt D` y\n```\npython a.py \\\n  --b 1\n# c\n```\n") == [
        "python a.py    --b 1", "python eval.py --ckpt D"]
