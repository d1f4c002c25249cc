# Command-line flags from a settings dataclass: every script's settings are one
# dataclass with a comment per field, and this one function turns its fields into flags.
#
#   x: int = 3                            --x 3              (int, float, str)
#   on: bool = True                       --on / --no-on
#   cache: Literal["none", "cursor"] = …  --cache cursor     (choices from the type)
#   prompt: list[str] = field(...)        --prompt a b --prompt c
#   tau: float | None = None              --tau 0.5          (unset stays None: "not given")
#
# The help text of a flag is its field's whole comment: the one after the field and the comment-only
# lines right below it, which continue it. Devices and dtypes spell "let the script choose"
# as "auto" everywhere (device_and_dtype, at the end, resolves them). A bad flag is a usage error: one
# line on stderr, exit status 2.
from __future__ import annotations

import argparse
import ctypes
import inspect
import math
import os
import platform
import re
import shlex
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Callable

import torch

from model import DTYPES


def number(text: str) -> float:
    # float(), less NaN: every comparison with NaN is False, so it would slip past range checks.
    x = float(text)
    if math.isnan(x):
        raise argparse.ArgumentTypeError("nan is not a number")
    return x


SCALARS = {int: int, float: number, str: str}


def parse(cls: type, argv: list[str] | None, description: str, defaults: dict | None = None,
          check: Callable | None = None):
    # argv -> cls(...). `defaults` overrides field defaults (a preset such as demo's --quick), so a
    # flag given explicitly still wins over it. `check(settings)` raises ValueError for what the flags
    # alone show to be wrong; its message becomes the usage error.
    comments = field_comments(inspect.getsource(cls))
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(description=description)
    # One line instead of argparse's usage block, which for a few dozen flags buries the message.
    p.error = lambda message: p.exit(2, f"{p.prog}: error: {message} (see --help)\n")
    for f in fields(cls):
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        default = f.default if f.default is not MISSING else f.default_factory()
        default = (defaults or {}).get(f.name, default)
        kw = dict(default=default, help=help_text(comments.get(f.name, ""), default))
        if hint is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            kw.update(type=item, nargs="+", action="extend", default=None)
        elif typing.get_origin(hint) is typing.Literal:
            kw.update(type=type(typing.get_args(hint)[0]), choices=typing.get_args(hint))
        elif hint in SCALARS:
            kw["type"] = SCALARS[hint]
        elif typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in typing.get_args(hint):
            (item,) = [a for a in typing.get_args(hint) if a is not type(None)]
            kw["type"] = SCALARS[item]
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for type {hint}")
        p.add_argument(flag, **kw)
    args = {k: v if v is not None else (defaults or {}).get(k) for k, v in vars(p.parse_args(argv)).items()}
    settings = cls(**{k: v for k, v in args.items() if v is not None})  # an unset list keeps its default
    try:
        if check:
            check(settings)
    except ValueError as e:
        p.error(str(e))
    return settings


def field_comments(source: str) -> dict[str, str]:
    # {field: its comment} from a dataclass's source: the comment after `name: type = default`, joined
    # with the comment-only lines that follow it (a comment too long for one line goes on below).
    comments, name = {}, None
    for line in source.splitlines():
        if field := re.match(r"\s+(\w+):.*?#\s*(.*)$", line):
            name, comments[field[1]] = field[1], field[2].strip()
        elif name and (more := re.match(r"\s+#\s*(.*)$", line)):
            comments[name] += " " + more[1].strip()
        else:
            name = None
    return comments


def help_text(comment: str, default) -> str:
    # The comment and the default; a list's as it is typed (--modes ar 0.9). An empty default ("" or [])
    # is left out: the comment says what leaving the flag out does. argparse formats help with %, so a
    # literal % is doubled.
    shown = shlex.join(map(str, default)) if isinstance(default, list) else repr(default)
    text = comment if default in ("", []) else f"{comment} (default: {shown})"
    return text.replace("%", "%%")


def at_least_1(s, *names: str) -> None:
    # A count a script cannot do without: one line naming the flag, before anything is measured.
    for name in names:
        values = getattr(s, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])) or values == []:
            raise SystemExit(f"error: --{name.replace('_', '-')} {values}: give numbers of at least 1")


def output_file(path: str, flag: str) -> None:
    # Where a script writes its results, checked before it measures for minutes: a file, its folder made.
    if Path(path).is_dir():
        raise SystemExit(f"error: {flag} {path} is a folder; give a file name in it")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: cannot write there ({e.strerror})") from None


def optional(module: str, purpose: str, requirements: str):
    # An optional dependency, imported where it is needed: when it is missing, one line that says what
    # needs it and which requirements file brings it (exit status 1), never a ModuleNotFoundError traceback.
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if getattr(e, "name", None) not in (top, module) and "None in sys.modules" not in str(e):
            raise  # the module is there but broken: keep the real error
        raise SystemExit(f"error: {purpose} needs {top}, which is not installed: pip install -r {requirements}") from e


def device_and_dtype(device: str, dtype: str, quantize: str = "none") -> tuple[str, torch.dtype]:
    # "auto": cuda when available, and bfloat16 on cuda, float32 on cpu, bfloat16 there too with --quantize
    # (torch's weight-only CPU kernels are fast in bfloat16, slower than float weights in float32: mars/quantize.py),
    # but for int4 on mars/cpu_kernels.cpp's AVX2 build, which works in float32 (it runs where the CPU has no
    # AVX-512 BF16, so bf16 arithmetic is slow, or where the compiler cannot build that: docs/benchmarks.md). The
    # device stays a string: it is printed and saved with the settings.
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device {device}: choose auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here; use --device cpu")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dtype == "auto":
        from mars import cpu_kernels
        avx2_int4 = device == "cpu" and quantize == "int4" and cpu_kernels.loaded_build() == "avx2"
        dtype = "bfloat16" if device.startswith("cuda") or (quantize != "none" and not avx2_int4) else "float32"
    return device, DTYPES[dtype]


GLIBC_KNOBS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (<malloc.h>)


def keep_freed_memory(device: str | torch.device) -> bool:
    # On the CPU under glibc: freed memory stays in the process for the next allocation. By default glibc
    # hands every freed block over 32 MB back to the kernel, and the next block of that size is faulted in
    # and zeroed again, 4 KiB at a time. The LM head's logits, each loss chunk and the attention scores
    # are such blocks, every step: training the 0.5B adapter in bf16 on 2 cores, 16% of the step's time
    # went there (docs/training.md). The price is some resident memory (7% there). Nothing changes where
    # glibc's own MALLOC_* variables are set (they win), off the CPU or off glibc. -> whether it applied.
    chosen = any(k in os.environ for k in GLIBC_KNOBS)
    if not str(device).startswith("cpu") or platform.libc_ver()[0] != "glibc" or chosen:
        return False
    libc = ctypes.CDLL(None)  # the running process, glibc among its libraries
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # a container's CPU quota (cgroup v2): "max" or "QUOTA PERIOD"


MEMORY_MAX, MEMORY_USED = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")  # cgroup v2


def available_memory() -> int | None:
    # Bytes this process may still take: the kernel's MemAvailable (free, and cache it can drop), within a
    # container's memory limit (cgroup v2). None where neither can be read (not Linux).
    found = []
    try:
        found.append(int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1]) << 10)
    except (OSError, TypeError):
        pass
    try:
        limit = MEMORY_MAX.read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int(MEMORY_USED.read_text())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def cores() -> int:
    # The cores this process may run on: its affinity, within a container's CPU quota (cgroup v2).
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = CPU_QUOTA.read_text().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n
