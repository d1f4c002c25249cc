# Self-distillation data for MARS fine-tuning on a real model: each prompt gets the model's own
# greedy reply. Training on it teaches the masks to predict what the model itself will say next,
# which is exactly what --verify accepts, while the clean stream's AR loss stays near its floor (the
# model already says these replies), so MARS training leaves its one-token behaviour alone.
#
# The prompts come from the Python standard library, offline: "complete this function" prompts built
# from public functions with docstrings, in the style of eval.py's HumanEval prompt, with every
# HumanEval entry point and docstring phrase kept out.
#
#   python -m tools.distill --prompts-out data/stdlib/prompts.jsonl            # only write prompts
#   python -m tools.distill --ckpt DIR --out data/stdlib/train.jsonl --limit 400
#   python -m tools.distill --source-out data/stdlib/source.jsonl              # framed source, no model
# The source rows are the modules' own code as chat replies: with self-distilled mask targets
# (train.py --mask-target self) the masks learn the model's own distribution on any text.
# Resumable: replies are appended one batch at a time, and a rerun skips the prompts already done.
from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from generate import Options, decode
from mars import cli
from mars.checkpoint import check_checkpoint, load_model
from mars.cli import device_and_dtype
from mars.eval import code_prompt, humaneval_problems
from mars.tokenizer import Tokenizer

# Pure-Python standard-library modules whose public functions carry docstrings. A fixed list, so the
# prompt set is the same on every machine with the same Python.
MODULES = (
    "base64", "bisect", "calendar", "colorsys", "csv", "difflib", "email.utils", "fnmatch", "fractions",
    "ftplib", "functools", "genericpath", "getopt", "gettext", "glob", "gzip", "heapq", "html", "imghdr",
    "inspect", "ipaddress", "keyword", "linecache", "locale", "mimetypes", "ntpath", "numbers", "opcode",
    "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "posixpath",
    "pprint", "quopri", "random", "re", "reprlib", "secrets", "shlex", "shutil", "smtplib", "statistics",
    "string", "sysconfig", "tarfile", "tempfile", "textwrap", "token", "tokenize", "traceback", "types",
    "typing", "urllib.parse", "uu", "uuid", "warnings", "wave", "weakref", "webbrowser", "xml.sax.saxutils",
    "zipfile",
    # The second set: more modules, appended so that the prompts of the first set stay as they were.
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.streams", "asyncio.subprocess", "asyncio.tasks",
    "bdb", "binascii", "cgi", "cmd", "code", "codecs", "codeop", "collections", "compileall",
    "concurrent.futures._base", "configparser", "contextlib", "copy", "copyreg", "dataclasses", "datetime",
    "decimal", "dis", "doctest", "email._header_value_parser", "email.base64mime", "email.charset",
    "email.encoders", "email.feedback", "email.header", "email.iterators", "email.message", "email.parser",
    "email.quoprimime", "encodings", "encodings.idna", "enum", "filecmp", "fileinput", "getpass", "graphlib",
    "hashlib", "hmac", "html.parser", "http.client", "http.cookiejar", "http.cookies", "http.server",
    "imaplib", "importlib.metadata", "importlib.util", "io", "json", "json.decoder", "json.encoder", "logging",
    "logging.handlers", "lzma", "mailbox", "modulefinder", "multiprocessing.util", "netrc", "nturl2path",
    "pdb", "pipes", "poplib", "profile", "pstats", "pty", "py_compile", "pyclbr", "pydoc", "queue",
    "rlcompleter", "runpy", "sched", "selectors", "shelve", "site", "socket", "socketserver", "sre_compile",
    "sre_parse", "ssl", "stat", "stringprep", "subprocess", "symtable", "tabnanny", "threading", "timeit",
    "trace", "tracemalloc", "unittest.case", "unittest.util", "urllib.request", "urllib.robotparser",
    "wsgiref.headers", "wsgiref.util", "xml.dom.minidom", "xml.etree.ElementTree", "xmlrpc.client", "zipapp",
    "zipimport", "zoneinfo",
)  # fmt: skip


@dataclass
class Settings:
    ckpt: str = ""  # the model that answers (a Hugging Face directory); empty = only write the prompts
    out: str = "data/stdlib/train.jsonl"  # chat JSONL: {"messages": [user, assistant]} per kept reply
    prompts_out: str = ""  # also write the prompts as JSONL ({"prompt": ...}) here
    source_out: str = ""  # also write the modules' source, in chunks framed as chat replies, here
    source_chunks: int = 4  # at most this many chunks per module
    chunk_lines: int = 30  # lines per chunk (cut at the next blank line)
    limit: int = 0  # use the first N prompts (0 = all)
    max_new_tokens: int = 768  # per reply; a reply cut here (no EOS) is dropped, never kept truncated
    batch_size: int = 16  # prompts decoded together (cursor cache)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"  # bf16 halves the time on CPU
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def humaneval_runs(problems: list[dict]) -> set[tuple[str, ...]]:
    # Every 8-word run of every HumanEval prompt: a text sharing one is kept out.
    return {tuple(w[i:i + 8]) for p in problems for w in [words(p["prompt"])] for i in range(len(w) - 7)}


def shares_a_run(w: list[str], runs: set[tuple[str, ...]]) -> bool:
    return any(tuple(w[i:i + 8]) in runs for i in range(len(w) - 7))


def stdlib_prompts() -> list[dict]:
    # [{"id": "module.name", "prompt": user message}], deduplicated by function name, decontaminated.
    problems = humaneval_problems()
    banned_names = {p["entry_point"] for p in problems}
    shingles = humaneval_runs(problems)
    rows, seen = [], set()
    for module_name in MODULES:
        try:
            with warnings.catch_warnings():  # imghdr and uu warn that they are deprecated
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(module_name)
        except ImportError:  # removed in a newer Python (imghdr, uu): the list is just shorter there
            continue
        for name, fn in sorted(vars(module).items()):
            if (name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__
                    or name in seen or name in banned_names or not inspect.getdoc(fn)):
                continue
            doc = inspect.getdoc(fn).split("\n\n")[0].strip()  # the first paragraph
            w = words(doc)
            if len(w) < 5 or shares_a_run(w, shingles):
                continue
            try:
                signature = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if "<" in signature:  # a default whose repr is not source code (<object ...>)
                continue
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            code = f'def {name}{signature}:\n    """{body.strip()}\n    """\n'
            rows.append({"id": f"{module_name}.{name}", "prompt": code_prompt(code)})
            seen.add(name)
    return rows


def source_rows(chunks_per_module: int, chunk_lines: int) -> list[dict]:
    # [{"messages": [user, assistant]}]: each module's source in chunks of about chunk_lines lines, cut at
    # blank lines, as a fenced reply; a chunk that defines a HumanEval entry point or shares an 8-word
    # run with a HumanEval prompt is dropped.
    problems = humaneval_problems()
    banned = re.compile(r"def (%s)\(" % "|".join(re.escape(p["entry_point"]) for p in problems))
    shingles = humaneval_runs(problems)
    rows = []
    for module_name in MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                file = inspect.getsourcefile(importlib.import_module(module_name))
        except (ImportError, TypeError):  # removed in a newer Python, or not written in Python
            continue
        if file is None:
            continue
        lines, chunks, start = Path(file).read_text(encoding="utf-8").splitlines(), [], 0
        while start < len(lines) and len(chunks) < chunks_per_module:
            end = start + chunk_lines
            while end < len(lines) and lines[end].strip():
                end += 1
            chunk = "\n".join(lines[start:end]).strip("\n")
            w = words(chunk)
            if chunk and not banned.search(chunk) and not shares_a_run(w, shingles):
                chunks.append(chunk)
            start = end + 1
        for i, chunk in enumerate(chunks, 1):
            user = f"Show part {i} of the source of Python's `{module_name}` module."
            rows.append({"messages": [{"role": "user", "content": user},
                                      {"role": "assistant", "content": f"```python\n{chunk}\n```"}]})
    return rows


def main(argv: list[str] | None = None) -> None:
    s = cli.parse(Settings, argv, "Self-distillation: a chat JSONL of the model's own greedy replies.")
    cli.at_least_1(s, "batch_size", "max_new_tokens")
    prompts = stdlib_prompts()[:s.limit or None]
    print(f"{len(prompts)} standard-library prompts", file=sys.stderr)
    if s.prompts_out:
        Path(s.prompts_out).parent.mkdir(parents=True, exist_ok=True)
        Path(s.prompts_out).write_text("".join(json.dumps(p) + "\n" for p in prompts))
    if s.source_out:
        rows = source_rows(s.source_chunks, s.chunk_lines)
        Path(s.source_out).parent.mkdir(parents=True, exist_ok=True)
        Path(s.source_out).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{s.source_out}: {len(rows)} source chunks", file=sys.stderr)
    if not s.ckpt:
        return
    try:
        path, _ = check_checkpoint(s.ckpt)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    out = Path(s.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log.jsonl")  # every prompt's outcome, kept or not: what a rerun skips
    done = {json.loads(line)["id"] for line in log.read_text().splitlines()} if log.exists() else set()
    todo = [p for p in prompts if p["id"] not in done]
    print(f"{len(done)} done before, {len(todo)} to go; settings {asdict(s)}", file=sys.stderr)
    tok = Tokenizer.from_pretrained(path)
    device, dtype = device_and_dtype(s.device, s.dtype)
    model = load_model(path, device, dtype)
    t0, new_tokens = time.perf_counter(), 0
    for i in range(0, len(todo), s.batch_size):
        batch = todo[i:i + s.batch_size]
        ids = [tok.encode_chat([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
               for p in batch]
        outs, _ = decode(model, ids, tok.mask_id, tok.stop_ids,
                         Options(tau=1.0, max_new_tokens=s.max_new_tokens, vocab_size=tok.vocab_size))
        with out.open("a") as f_out, log.open("a") as f_log:
            for p, o in zip(batch, outs):
                ended = bool(o) and o[-1] in tok.stop_ids
                if ended:
                    reply = tok.decode(o[:-1])
                    f_out.write(json.dumps({"messages": [{"role": "user", "content": p["prompt"]},
                                                         {"role": "assistant", "content": reply}]}) + "\n")
                f_log.write(json.dumps({"id": p["id"], "tokens": len(o), "kept": ended}) + "\n")
        new_tokens += sum(map(len, outs))
        n, elapsed = min(i + s.batch_size, len(todo)), time.perf_counter() - t0
        print(f"[distill] {n}/{len(todo)} prompts | {new_tokens / elapsed:.0f} tok/s | "
              f"elapsed {elapsed / 60:.1f} min | ETA {elapsed / n * (len(todo) - n) / 60:.1f} min",
              file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    kept = sum(r["kept"] for r in rows)
    print(f"{out}: {kept} replies kept of {len(rows)}; {len(rows) - kept} cut at --max-new-tokens "
          f"{s.max_new_tokens} and dropped", file=sys.stderr)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
