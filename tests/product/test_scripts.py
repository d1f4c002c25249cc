# Every script answers --help the way a user starts it: the root scripts as `python X.py`, the
# tools as `python -m tools.X`, from the repository root and with no sys.path edits. Each flag
# comes from a field of the script's Settings dataclass (cli.py), with that field's comment as help.
import importlib
import io
import json
import platform
import shlex
import subprocess
import sys
import tokenize
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in ROOT.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
# a root command and the module holding its Settings
COMMANDS = {"serve": "mars.serve", "eval": "mars.eval", "generate": "mars.prompts"}
# every tool a user runs (tools/gpu_stages.py is no command: the stages tools/gpu_check.py launches)
TOOLS = sorted(f"tools.{p.stem}" for p in (ROOT / "tools").glob("*.py")
               if 'if __name__ == "__main__":' in p.read_text())

# One interpreter for all of them (torch imports once): run each as __main__ with argv [name, --help].
RUN_ALL = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")  # runpy warns when a module it runs was imported by an earlier one
out = {}
for name in sys.argv[1:]:
    sys.argv, buf, code = [name, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    out[name] = {"code": code, "help": buf.getvalue()}
print(json.dumps(out))
"""


def commented_fields(cls: type) -> dict[str, str]:
    # {field: its whole comment}: the trailing one and the comment-only lines right below it, which go on
    # with it. Read with the tokenizer (not cli.py's regex).
    import inspect

    found, line, field = {}, [], None
    for t in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if t.type in (tokenize.NEWLINE, tokenize.NL):
            if line and line[0].type != tokenize.COMMENT and line[-1].type != tokenize.COMMENT:
                field = None  # a line of code without a comment ends the one above
            line = []
            continue
        if t.type in (tokenize.INDENT, tokenize.DEDENT):
            continue
        line.append(t)
        if t.type != tokenize.COMMENT:
            continue
        text = t.string.lstrip("#").strip()
        if len(line) > 2 and line[0].type == tokenize.NAME and line[1].string == ":":
            field = line[0].string
            found[field] = text
        elif len(line) == 1 and field:  # a comment-only line: the comment above goes on
            found[field] += " " + text
        else:
            field = None
    return found


def test_every_script_answers_help():
    assert {"train", "generate", "serve"} <= set(SCRIPTS) and "tools.demo" in TOOLS
    run = subprocess.run([sys.executable, "-c", RUN_ALL, *SCRIPTS, *TOOLS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.splitlines()[-1])
    for name in SCRIPTS + TOOLS:
        code, text = results[name]["code"], results[name]["help"]
        assert code == 0 and text.startswith("usage:"), (name, code, text[:300])
        if name == "tools.lm_eval_mars":  # lm-eval's own CLI; its Settings are model args, not flags
            assert "lm-eval" in text or "lm_eval" in text, text[:300]
            continue
        if name == "tools.vllm_engine":  # run by tools/vllm_check.py inside vLLM's venv: two file arguments
            continue
        flat = "".join(text.split())  # argparse wraps lines, also after hyphens: compare without whitespace
        settings = importlib.import_module(COMMANDS.get(name, name)).Settings
        comments = commented_fields(settings)
        for f in fields(settings):
            flag = "--" + f.name.replace("_", "-")
            assert flag in text, (name, flag)
            if f.type in (bool, "bool"):
                assert "--no-" + flag[2:] in text, (name, flag)
            assert comments.get(f.name), f"{name}.Settings.{f.name} has no comment: its flag has no help"
            assert "".join(comments[f.name].split()) in flat, (name, flag)  # the whole comment, never a cut one
            if isinstance(default := defaults(f), list) and default:  # as it is typed: --modes ar 0.9
                assert "".join(f"(default: {shlex.join(map(str, default))})".split()) in flat, (name, flag)


def defaults(f):
    from dataclasses import MISSING

    return f.default if f.default is not MISSING else f.default_factory()


def test_help_is_the_whole_comment_of_a_field(capsys):
    # A comment that goes on below its field's line is help too (serve's --draft-budget), and a list's
    # default is shown as it is typed; an empty default says nothing the comment does not.
    from mars import cli, serve
    from mars import eval as evaluation

    def flat_help(cls: type) -> str:
        with pytest.raises(SystemExit):
            cli.parse(cls, ["--help"], "x")
        return "".join(capsys.readouterr().out.split())

    text = flat_help(serve.Settings)
    assert "".join(("verify rows' drafts and masks per row: auto = sized to the batch each step from the cost of a "
                    "forward measured at launch; N = fixed; 0 = the full tree (default: 'auto')").split()) in text
    assert "".join("empty = env MARS_API_KEY, else none --".split()) in text  # no "(default: '')"
    assert "".join("ar, a threshold tau, verify".split()) in (text := flat_help(evaluation.Settings))
    assert "(default:ar0.9)" in text and "(default:'')" not in text
    assert cli.help_text("rate in %", 5) == "rate in %% (default: 5)"  # argparse formats help with %


def test_a_missing_optional_dependency_names_its_requirements_file(monkeypatch):
    from mars import cli
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # hidden, installed or not
    with pytest.raises(SystemExit, match="the plot needs matplotlib, which is not installed: "
                                         "pip install -r requirements-extras.txt"):
        cli.optional("matplotlib", "the plot", "requirements-extras.txt")
    assert cli.optional("json", "x", "y").dumps([1]) == "[1]"
    # lm-eval hidden: even --help gets one line, not a traceback
    code = ("import sys, runpy; sys.modules['lm_eval'] = None; sys.argv = ['x', '--help']; "
            "runpy.run_module('tools.lm_eval_mars', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip() == ("error: tools/lm_eval_mars.py (the lm-eval model) needs lm_eval, which is not "
                                  "installed: pip install -r requirements-eval.txt")


# Five allocations of a 64 MB tensor, six times over: the page faults of each round, and whether
# cli.keep_freed_memory applied. In its own interpreter: the allocator is the process's.
FAULTS = """
import json, resource, sys
import torch
from mars import cli
applied = cli.keep_freed_memory(sys.argv[1])
def faults():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        x = torch.ones(16 * 2**20)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"applied": applied, "faults": [faults() for _ in range(6)]}))
"""


def allocation_faults(device: str, **env: str) -> dict:
    import os

    run = subprocess.run([sys.executable, "-c", FAULTS, device], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return json.loads(run.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_on_the_cpu_freed_memory_is_reused_without_new_page_faults():
    pages = 16 * 2**20 * 4 // 4096  # one allocation's pages
    kept, system = allocation_faults("cpu"), allocation_faults("cuda")  # off the CPU, glibc's default
    assert kept["applied"] and not system["applied"]
    assert all(f >= 4 * pages for f in system["faults"])  # every allocation faulted in again
    assert all(f < pages // 4 for f in kept["faults"][2:])  # once the heap has grown, reused
    # glibc's own variables win: set, nothing is changed.
    chosen = allocation_faults("cpu", MALLOC_MMAP_MAX_="65536")
    assert not chosen["applied"] and all(f >= 4 * pages for f in chosen["faults"])


def test_bench_model_measures_a_small_checkpoint_named_relative_to_here(tmp_path, monkeypatch, capsys):
    # The byte-level demo model has 260 ids; its folder is named from where the user stands, while the measuring
    # processes run from the repository's folder.
    from conftest import tiny_checkpoint
    from tools import bench_model

    tiny_checkpoint(tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--reps, --forwards, --seq-len, --threads and --layers must be at least 1"):
        bench_model.main(["--ckpt", "ck", "--reps", "0"])
    bench_model.main(["--ckpt", "ck", "--reps", "1", "--forwards", "1", "--seq-len", "8", "--threads", "1"])
    out = capsys.readouterr().out
    assert "float32: prefill time ours/transformers = " in out and "bfloat16: prefill time" in out
