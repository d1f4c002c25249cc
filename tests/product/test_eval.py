# eval.py (the benchmark runner) and tools/distill.py (self-distillation data), on tiny models: the
# code runner's verdicts, answer extraction, batch equals single, and distillation's prompt set.
import contextlib
import json
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_checkpoint
from generate import Options, decode
from mars import eval as ev
from mars.checkpoint import DEFAULT_CKPT, warn_untrained_masks
from tools import distill

# ---- the HumanEval code runner ----

PROBLEM = {"task_id": "Toy/0", "entry_point": "add",
           "prompt": 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum of xs."""\n',
           "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"}


# The sandbox needs bubblewrap (apt install bubblewrap), which `.ci/run` installs; elsewhere its
# tests skip where it is missing, and with CI set they fail.
needs_sandbox = pytest.mark.skipif(not ev.sandbox_available() and not os.environ.get("CI"),
                                   reason="bubblewrap is not installed: apt install bubblewrap")


@needs_sandbox
def test_run_program_success_exception_and_timeout():
    assert ev.run_program("print('ok')\n", timeout=10) == (True, "")
    ok, err = ev.run_program("raise KeyError('boom')\n", timeout=10)
    assert not ok and "KeyError" in err
    ok, err = ev.run_program("while True:\n    pass\n", timeout=1)
    assert (ok, err) == (False, "timeout")


@pytest.mark.parametrize("unsafe", [pytest.param(False, marks=needs_sandbox), True])
def test_a_program_starts_while_another_thread_holds_what_a_fork_would_hang_on(unsafe):
    # eval.py scores in threads. A forked copy of this process that ran Python before its exec would clear
    # the other threads' states, and a destructor there can block for good (a torch.distributed process
    # group's does): the parent would wait on that child forever. The limits are set after the exec instead.
    parent = os.getpid()

    class BlocksInAFork:
        def __del__(self):
            if os.getpid() != parent:
                time.sleep(60)

    held, stop = threading.Event(), threading.Event()

    def hold() -> None:
        state = threading.local()
        state.x = BlocksInAFork()
        held.set()
        stop.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    result = []
    runner = threading.Thread(target=lambda: result.append(ev.run_program("print('ok')\n", 10, unsafe=unsafe)),
                              daemon=True)
    runner.start()
    runner.join(30)
    stop.set()
    assert result == [(True, "")]


def test_a_launch_that_fails_before_its_program_is_an_error_not_a_verdict(tmp_path):
    # A cgroup that cannot be joined would otherwise read as a program that failed its tests.
    with pytest.raises(RuntimeError, match=r"program could not start \(/bin/true\): FileNotFoundError.*no-such-group"):
        ev.launch(["/bin/true"], [str(tmp_path / "no-such-group")], {}, str(tmp_path), tmp_path / "o", tmp_path / "e")
    p = ev.launch(["sh", "-c", "ulimit -f"], [], {"RLIMIT_FSIZE": 3 << 10}, str(tmp_path), tmp_path / "o",
                  tmp_path / "e")  # found on PATH
    assert p.wait() == 0 and (tmp_path / "o").read_text().strip() == "6"  # 512-byte blocks: the limit holds


def test_a_launch_that_stalls_before_its_program_is_ended_and_named(tmp_path, monkeypatch):
    # A cgroup whose procs file blocks the launcher's write (a FIFO here) must not hold eval.py up for good.
    monkeypatch.setattr(ev, "LAUNCH_S", 1.0)
    (tmp_path / "g").mkdir()
    os.mkfifo(tmp_path / "g" / "cgroup.procs")
    said = []

    def start() -> None:
        try:
            ev.launch(["/bin/true"], [str(tmp_path / "g")], {}, str(tmp_path), tmp_path / "o", tmp_path / "e")
        except RuntimeError as e:
            said.append(str(e))

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(15)
    assert said == ["the program could not start (/bin/true): its launcher had not reached its exec after 1 s"]


@needs_sandbox
def test_the_sandbox_dev_holds_what_exists_and_nothing_writable(monkeypatch):
    # Some containers have no /dev/full, where bubblewrap's own --dev fails every program: a node the
    # host lacks is left out, and /dev is read-only with no /dev/shm.
    monkeypatch.setattr(ev, "DEVICES", (*ev.DEVICES, "no-such-device"))
    program = ("import os\nassert open('/dev/urandom', 'rb').read(4) and 'no-such-device' not in os.listdir('/dev')\n"
               "print('x', file=open('/dev/null', 'w'))\n")
    assert ev.run_program(program, timeout=10) == (True, "")
    for path in ("/dev/shm/x", "/dev/x"):
        ok, err = ev.run_program(f"open({path!r}, 'w').write('1')\n", timeout=10)
        assert not ok and ("No such file" in err or "Read-only" in err), path


@needs_sandbox
def test_run_program_is_isolated(tmp_path):
    # The program runs in its own temporary directory, not ours, and cannot exhaust our memory.
    ok, _ = ev.run_program(f"import os\nassert os.getcwd() != {str(tmp_path)!r}\nopen('x', 'w').write('1')\n", 10)
    assert ok and not (tmp_path / "x").exists()
    ok, err = ev.run_program("x = bytearray(8 << 30)\n", timeout=10)  # 8 GiB: over the 4 GiB limit
    assert not ok and "MemoryError" in err


def processes_with(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
    return found


@needs_sandbox
def test_a_program_that_escapes_the_session_dies_at_the_timeout():
    # A grandchild in a session of its own survives a process-group kill; the PID namespace does not.
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.execvp('sleep', ['sleep', '31.4159'])\n    os._exit(0)\ntime.sleep(60)\n")
    assert ev.run_program(code, timeout=1.5) == (False, "timeout")
    deadline = time.monotonic() + 5
    while processes_with("31.4159") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with("31.4159")


@needs_sandbox
def test_a_program_cannot_write_outside_its_folder_or_reach_the_network(tmp_path):
    target = tmp_path / "escaped"
    code = (f"import os\nos.system('touch {target}')\n"
            f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError:\n    pass\n")
    ev.run_program(code, timeout=10)
    assert not target.exists()
    with socket.socket() as server:  # a loopback port of this machine, listening
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        ok, err = ev.run_program(code, timeout=10)
        assert not ok and ("Network is unreachable" in err or "refused" in err), err
        with pytest.raises(TimeoutError):
            server.accept()


@needs_sandbox
def test_a_fork_bomb_is_bounded_and_an_honest_program_still_passes():
    code = ("import os, time\nn = 0\ntry:\n    while n < 5000:\n        if os.fork() == 0:\n"
            "            time.sleep(3)\n            os._exit(0)\n        n += 1\n"
            "except OSError:\n    raise SystemExit(f'bounded at {n}')\n")
    ok, err = ev.run_program(code, timeout=10)
    assert not ok and "bounded at" in err and int(err.split("bounded at ")[1].split()[0]) < 200
    reply = "```python\ndef add(xs):\n    return sum(xs)\n```"
    assert ev.run_program(ev.humaneval_program(PROBLEM, reply), timeout=10) == (True, "")


@needs_sandbox
def test_a_fork_bomb_leaves_a_program_running_beside_it_its_own_processes():
    # Where a pids cgroup bounds each program, one program's fork bomb does not take the processes of
    # another that runs at the same time (the per-user limit alone would be shared by both).
    if "pids" not in ev.machine_bounds():
        assert any("no writable pids cgroup" in gap for gap in ev.sandbox_gaps())
        return
    from concurrent.futures import ThreadPoolExecutor

    bomb = ("import os, time\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(4)\n"
            "            os._exit(0)\nexcept OSError:\n    time.sleep(3)\n")
    threads = min(8, ev.program_limits(ev.machine_bounds(), True, 1).processes - 1)  # beside its main thread
    honest = ("import threading, time\ntime.sleep(1)\n"
              f"ts = [threading.Thread(target=print) for _ in range({threads})]\n[t.start() for t in ts]\n"
              "[t.join() for t in ts]\n")
    with ThreadPoolExecutor(2) as pool:
        pool.submit(ev.run_program, bomb, 6)
        assert pool.submit(ev.run_program, honest, 6).result() == (True, "")


@needs_sandbox
def test_the_sandbox_runs_for_a_user_who_is_not_root(monkeypatch):
    # setpriv cannot change a user who is not root: a user namespace maps them to the sandbox's user instead,
    # and their process-count limit counts their own processes too.
    monkeypatch.setattr(ev.os, "geteuid", lambda: 1000)
    argv = ev.sandbox(Path("/tmp/program.py"))
    assert "--unshare-user" in argv and not any(a.endswith("setpriv") for a in argv)
    ok, err = ev.run_program("import os, sys, threading\nt = threading.Thread(target=print)\nt.start()\n"
                             "sys.exit(0 if os.getuid() == 65534 else 1)\n", timeout=10)
    assert ok, err


@needs_sandbox
def test_stderr_is_bounded_and_a_sandbox_that_fails_everything_is_said(monkeypatch, tmp_path):
    # 20 MiB to stderr ends the program at its 16 MiB file limit and keeps the end of it, not all of it.
    ok, err = ev.run_program("import sys\nfor _ in range(20):\n    sys.stderr.write('x' * (1 << 20))\n", timeout=10)
    assert not ok and len(err) <= 300
    # A sandbox that fails a program doing nothing would score every reply as failed: the run stops
    # before the model loads.
    monkeypatch.setattr(ev, "run_program", lambda *a, **kw: (False, "setpriv: setresuid failed"))
    monkeypatch.setattr(ev, "load_model", lambda *a, **kw: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit, match="the sandbox cannot run a program that does nothing \\(setpriv: "
                                         "setresuid failed\\), so every reply would fail"):
        ev.main(["--ckpt", str(tmp_path), "--task", "humaneval"])


@needs_sandbox
def test_model_code_sees_neither_the_checkout_nor_the_home_directory():
    # Only the interpreter is shown: this test file (the checkout) and a readable file in $HOME are not.
    with tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix=".mars-sandbox-test-", suffix=".txt") as secret:
        secret.write("secret\n")
        secret.flush()
        os.chmod(secret.name, 0o644)
        for path in (__file__, secret.name, str(Path.home())):
            code = (f"import os\ntry:\n    os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read()\n"
                    f"except OSError:\n    raise SystemExit(0)\nraise SystemExit('shown: ' + {path!r})\n")
            assert ev.run_program(code, timeout=10) == (True, ""), path


@needs_sandbox
def test_scratch_space_and_memory_are_bounded_per_program():
    # /tmp holds PROGRAM_SCRATCH bytes in all, however many files: the 16 MiB per-file limit alone would
    # let 600 MB through. Where a cgroup can be made, forked processes share one memory bound.
    if not ev.bwrap_has_size():
        pytest.skip("this bubblewrap has no --size")
    files = ev.PROGRAM_SCRATCH // (8 << 20) + 2
    code = f"for i in range({files}):\n    open(f'/tmp/f{{i}}', 'wb').write(bytes(8 << 20))\n"
    ok, err = ev.run_program(code, timeout=10)
    assert not ok and "No space left on device" in err
    if "memory" not in ev.machine_bounds():
        assert any("no writable memory cgroup" in gap for gap in ev.sandbox_gaps())
        return
    n = ev.PROGRAM_MEMORY // (256 << 20) + 2  # children of 256 MiB each, together over the program's bound
    code = ("import os, time\nkids = []\nfor _ in range(%d):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = bytearray(256 << 20)\n        x[::4096] = bytes(len(x[::4096]))\n        time.sleep(2)\n"
            "        os._exit(0)\n    kids.append(pid)\n"
            "codes = [os.waitpid(k, 0)[1] for k in kids]\nraise SystemExit(0 if not any(codes) else 'killed')\n" % n)
    assert not ev.run_program(code, timeout=20)[0]
    assert ev.run_program("print('ok')\n", timeout=10) == (True, "")


@needs_sandbox
def test_the_sandbox_runs_an_interpreter_that_lives_under_tmp(tmp_path, monkeypatch):
    # A virtual environment in a checkout under /tmp: its python is a link there, and the sandbox's
    # private /tmp must not hide it.
    import sys

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert str(tmp_path).startswith("/tmp/")
    assert ev.run_program("print('ok')\n", timeout=10) == (True, "")


def test_without_bubblewrap_model_code_is_refused_unless_unsafe(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ev, "sandbox_available", lambda: False)
    with pytest.raises(RuntimeError, match="apt install bubblewrap"):
        ev.run_program("print(1)\n", timeout=5)
    assert ev.run_program("print(1)\n", timeout=5, unsafe=True) == (True, "")
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as e:
        ev.main(["--ckpt", str(tmp_path), "--task", "humaneval"])
    assert e.value.code == 2 and "apt install bubblewrap" in capsys.readouterr().err


def test_limits_bound_a_programs_memory_with_a_cgroup_or_without_one(monkeypatch):
    # Under a memory cgroup the program's tree is bounded at PROGRAM_MEMORY, and the per-process limits only
    # stop runaway forks and reservations. Without one, processes x address space is the bound: 1-2 GiB.
    caged = ev.program_limits({"memory", "pids"}, root=True, at_once=4)
    assert (caged.memory, caged.address_space, caged.processes, caged.nproc) == (1 << 30, 4 << 30, 128, 4 * 128)
    assert ev.program_limits({"memory"}, root=True, at_once=4).nproc == 128  # no pids cgroup: one pool for all
    for bound in (set(), {"pids"}):
        bare = ev.program_limits(bound, root=True, at_once=4)
        assert bare.memory == bare.processes * bare.address_space and 1 << 30 <= bare.memory <= 2 << 30
        assert bare.processes >= 2 and bare.nproc == 4 * bare.processes  # each program its share
    mine = ev.program_limits(set(), root=False, at_once=4, running=50)  # as you, beside your 50 tasks and bwrap's
    assert mine.nproc == 50 + 4 * (mine.processes + ev.BWRAP_TASKS) and mine.memory == bare.memory
    # Where only a pids cgroup can be made (v1), it holds each program to its share.
    listing = Path(__file__).parent / "no-such-cgroup-file"  # unread: the hierarchies' tops
    monkeypatch.setattr(ev, "PROC_CGROUP", listing)
    made = {}
    monkeypatch.setattr(ev, "new_cgroup", lambda root, knobs: (made.update(knobs), root)[1]
                        if root.name == "pids" else None)
    assert ev.program_cgroups() == [Path("/sys/fs/cgroup/pids")]
    assert made == {"pids.max": bare.processes + ev.BWRAP_TASKS}
    # The warning states the bound.
    monkeypatch.setattr(ev, "bwrap_has_size", lambda: True)
    monkeypatch.setattr(ev, "remove_stale_cgroups", lambda: None)
    monkeypatch.setattr(ev, "machine_bounds", lambda: {"pids"})
    (memory,) = ev.sandbox_gaps()
    assert f"{bare.processes} processes or threads of {bare.address_space >> 20} MiB" in memory
    assert memory.endswith(f"{bare.memory >> 20} MiB a program")
    # Without a pids group either, one program may take every task the programs that run at once share.
    monkeypatch.setattr(ev, "machine_bounds", lambda: set())
    monkeypatch.setattr(ev, "cores", lambda: 4)
    memory, pids = ev.sandbox_gaps()
    pool = ev.program_limits(set(), os.geteuid() == 0, 4).nproc
    assert f"{pool} processes or threads of {bare.address_space >> 20} MiB" in memory and pool > bare.processes
    assert f"{pool * bare.address_space >> 20} MiB a program, the processes the programs" in memory
    assert "share their processes" in pids
    monkeypatch.setattr(ev, "machine_bounds", lambda: {"memory", "pids"})
    assert ev.sandbox_gaps() == []
    # A Python installation that holds your home folder shows it to every program: said.
    monkeypatch.setattr(ev, "python_homes", lambda: [str(Path.home())])  # made as python -m venv ~
    monkeypatch.chdir("/")
    (home,) = ev.sandbox_gaps()
    assert home.startswith(f"the Python installation at {Path.home()}, which programs can read, holds your home "
                           "folder")


def test_a_programs_cgroups_go_below_eval_pys_own(tmp_path, monkeypatch):
    # The bounds set on eval.py's own group (a service's MemoryMax, a batch job's) bind its programs too: their
    # groups go below it, in each hierarchy, never at the top.
    listing = tmp_path / "cgroup"
    listing.write_text("9:name=systemd:/\n8:pids:/jobs/42\n4:memory:/svc/a\n1:cpu,cpuacct:/\n0::/user.slice/x\n")
    monkeypatch.setattr(ev, "PROC_CGROUP", listing)
    assert ev.cgroup_root("memory") == Path("/sys/fs/cgroup/memory/svc/a")
    assert ev.cgroup_root("pids") == Path("/sys/fs/cgroup/pids/jobs/42")
    assert ev.cgroup_root("") == Path("/sys/fs/cgroup/user.slice/x")
    asked = []
    monkeypatch.setattr(ev, "new_cgroup", lambda root, knobs: asked.append(root))
    assert ev.program_cgroups() == []  # none made: each below our own group first, then at the top
    assert asked == [Path("/sys/fs/cgroup/user.slice/x"), Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory/svc/a"),
                     Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids/jobs/42"), Path("/sys/fs/cgroup/pids")]
    monkeypatch.undo()
    groups = ev.program_cgroups()  # this machine's: below this process's own, where it can make any
    try:
        assert all(group.parent in (*ev.cgroup_roots(""), *ev.cgroup_roots("memory"), *ev.cgroup_roots("pids"))
                   for group in groups)
    finally:
        for group in groups:
            ev.remove_cgroup(group)


def test_a_failed_programs_message_names_the_limit_that_stopped_it(tmp_path):
    # A kill leaves no stderr: the cgroup's OOM kills and the signal (bubblewrap passes on signal N as exit
    # status 128 + N) say why.
    caged, bare = ev.program_limits({"memory"}, True, 1), ev.program_limits(set(), True, 1)
    assert ev.failure(128 + 9, "", 1, caged, 11) == ev.failure(-9, "", 1, caged, 11) == \
        "killed: out of memory (limit 1024 MiB)"
    said = "Traceback (most recent call last):\n  ...\nMemoryError\n"
    assert ev.failure(1, said, 0, bare, 11) == f"out of memory (limit 512 MiB of address space a process)\n{said}"
    assert ev.failure(128 + 24, "", 0, bare, 11) == "killed: over its CPU time (11 s)"  # SIGXCPU
    assert ev.failure(-9, "", 0, bare, 11) == "killed by SIGKILL"
    assert ev.failure(1, "KeyError: 'boom'\n", 0, bare, 11) == "KeyError: 'boom'\n"
    # The kernel's count: cgroup v2's memory.events, v1's memory.oom_control.
    v2, v1, pids = tmp_path / "v2", tmp_path / "v1", tmp_path / "pids"
    for group in (v2, v1, pids):
        group.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert ev.oom_kills([v2, v1, pids]) == 3 and ev.oom_kills([pids]) == 0


def test_a_program_killed_for_memory_is_said_to_be(monkeypatch):
    # A program that holds more than its cgroup allows, then sleeps, is killed by the kernel at once, and the
    # verdict says so rather than nothing. Bubblewrap is left out (this needs only a writable memory cgroup).
    if "memory" not in ev.machine_bounds():
        pytest.skip("no writable memory cgroup here")
    import sys

    monkeypatch.setattr(ev, "PROGRAM_MEMORY", 64 << 20)
    monkeypatch.setattr(ev, "sandbox", lambda program: [sys.executable, "-I", str(program)])
    code = "import time\nx = bytearray(256 << 20)\nx[::4096] = bytes(len(x[::4096]))\ntime.sleep(30)\n"
    t0 = time.monotonic()
    assert ev.run_program(code, timeout=20) == (False, "killed: out of memory (limit 64 MiB)")
    assert time.monotonic() - t0 < 15


def test_without_a_cgroup_an_allocation_past_the_address_space_is_said_to_be():
    ok, err = ev.run_program("x = bytearray(2 << 30)\n", timeout=10, unsafe=True)  # no cgroup: 512 MiB a process
    assert not ok and err.startswith("out of memory (limit 512 MiB of address space a process)\n")
    assert "MemoryError" in err
    assert ev.run_program("x = bytearray(256 << 20)\nprint(len(x))\n", timeout=10, unsafe=True) == (True, "")


@pytest.mark.parametrize("reply, passed", [
    ("Here it is:\n```python\ndef add(xs):\n    return sum(xs)\n```\nDone.", True),
    ("```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```", True),  # List from the prompt
    ("```\ndef add(xs):\n    return sum(xs) + 1\n```", False),  # wrong answer
    ("    return sum(xs)\n", True),  # a body only: completed onto the stub
    ("```python\n    return sum(xs)\n```", True),  # a body only, fenced: its indentation is the body's
    ("```python\ndef add(xs):\n    return sum(xs\n```", False),  # syntax error
    ("1. The function:\n   ```python\n   def add(xs):\n       return sum(xs)\n   ```\n", True),  # in a list item
    # a reply's classes, looked up by their module as dataclasses and pickle do
    ("```python\nfrom dataclasses import dataclass\n@dataclass\nclass Box:\n    next: 'Box' = None\n    n: int = 0\n"
     "def add(xs):\n    return Box(n=sum(xs)).n\n```", True),
    ("```python\nimport pickle\nclass Box:\n    pass\ndef add(xs):\n    b = Box()\n    b.n = sum(xs)\n"
     "    return pickle.loads(pickle.dumps(b)).n\n```", True),
])
@needs_sandbox
def test_humaneval_program_verdicts(reply, passed):
    assert ev.score("humaneval", {"problem": PROBLEM}, reply, 10) is passed


@needs_sandbox
@pytest.mark.parametrize("tail, passed", [
    ("exit()\n", False),  # leaves before check() runs: exit status 0, and still no pass
    ("import sys\nsys.exit(0)\n", False),
    ("import unittest\nunittest.main(argv=['x'], exit=True)\n", False),  # its own tests, then an exit
    ("if __name__ == '__main__':\n    print(input())\n", True),  # its main block is not run
])
def test_a_reply_passes_only_by_the_tests_check(tail, passed):
    reply = f"```python\ndef add(xs):\n    return sum(xs) + (1 if not xs else 0)\n\n{tail}```"  # wrong on []
    right = f"```python\ndef add(xs):\n    return sum(xs)\n\n{tail}```"
    assert ev.score("humaneval", {"problem": PROBLEM}, reply, 10) is False
    assert ev.score("humaneval", {"problem": PROBLEM}, right, 10) is passed


@needs_sandbox
def test_a_reply_may_use_the_prompts_helpers_and_the_block_that_defines_the_entry_point():
    # HumanEval/10's prompt defines is_palindrome for make_palindrome: a reply that gives make_palindrome
    # alone uses it. And a reply whose first block is an example, not the solution, is scored by the
    # block that defines the entry point.
    p = ev.humaneval_problems()[10]
    body = p["canonical_solution"]
    solution = f"def make_palindrome(string: str) -> str:\n{body}"
    assert ev.score("humaneval", {"problem": p}, f"```python\n{solution}```", 10)
    example = "```python\n>>> make_palindrome('cat')\n'catac'\n```\n"
    assert ev.score("humaneval", {"problem": p}, f"For example:\n{example}Solution:\n```python\n{solution}```", 10)


@needs_sandbox
def test_humaneval_data_ships_with_the_package():
    problems = ev.humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    # The canonical solutions pass through our program builder and runner.
    for p in problems[:3]:
        assert ev.run_program(ev.humaneval_program(p, p["prompt"] + p["canonical_solution"]), 10)[0]


# ---- answer extraction ----

@pytest.mark.parametrize("reply, ok", [
    ("3 apples and 4 more make 7. The answer is 7.", True),
    ("The answer is 1,234.", False),  # reference is 7
    ("Step 1: 10 - 3 = 7", True),  # no "answer is": the last number
    ("The answer is $7.00.", True),
    ("I cannot tell.", False),
    ("At first I guessed the answer is 10. Checking again, the answer is 7.", True),  # the last one
])
def test_gsm8k_extraction(reply, ok):
    assert ev.score("gsm8k", {"reference": "7"}, reply, 1.0) is ok
    assert ev.score("gsm8k", {"reference": "1,000"}, "The answer is 1000.", 1.0)  # a reference with a comma


def test_gsm8k_local_file(tmp_path):
    f = tmp_path / "gsm8k.jsonl"
    f.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    items = ev.load_task(ev.Settings(task="gsm8k", data=str(f)))
    assert items[0]["reference"] == "2" and items[0]["prompt"].startswith("1 + 1?")
    f.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{f}:1")):
        ev.load_task(ev.Settings(task="gsm8k", data=str(f)))
    # an answer without GSM8K's "#### N" would be scored wrong whatever the reply: refused, named
    f.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n"
                 + json.dumps({"question": "2 + 2?", "answer": "The answer is 4"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{f}:2: the answer must end in '#### N'")):
        ev.load_task(ev.Settings(task="gsm8k", data=str(f)))
    with pytest.raises(ValueError, match=re.escape(f"--data {tmp_path} is a folder; pass a JSONL file")):
        ev.load_task(ev.Settings(task="gsm8k", data=str(tmp_path)))


def test_modes_parse():
    assert ev.mode_kwargs("ar", 4) == {"tau": 1.0, "B": 1}
    assert ev.mode_kwargs("0.9", 4) == {"tau": 0.9, "B": 4}
    assert ev.mode_kwargs("verify", 4) == {"verify": True, "B": 4, "draft_budget": ev.DEFAULT_BUDGET}
    assert ev.mode_kwargs("verify-tree", 4) == {"verify": True, "B": 4, "layout": "tree"}  # the full tree
    assert ev.mode_kwargs("verify-6", 4) == {"verify": True, "B": 4, "draft_budget": 6}
    assert ev.mode_kwargs("verify-chain", 4) == {"verify": True, "B": 4, "layout": "chain"}
    assert ev.mode_kwargs("tol-0.5", 4) == {"verify": True, "B": 4, "draft_budget": ev.DEFAULT_BUDGET, "tolerance": 0.5}
    for bad in ("fast", "1.5", "verify-ring", "verify-0", "verify--2", "cal-0.9", "tol-0", "tol-x", "lol-0.5"):
        with pytest.raises(ValueError, match="--modes"):
            ev.mode_kwargs(bad, 4)


def test_a_calibration_map_in_the_checkpoint_is_ignored_with_one_note(tmp_path, capsys):
    # Calibrated thresholds were removed (docs/method.md §16): a checkpoint that carries their map
    # evaluates as before, and one line says the file is ignored.
    path, data = tmp_path / "ckpt", demo_data(tmp_path / "test.jsonl", 2)
    tiny_checkpoint(path, sharpen=20)
    args = ["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "0.5", "--max-new-tokens", "8"]
    ev.main([*args, "--out", str(tmp_path / "alone.json")])
    assert "calibration.json" not in capsys.readouterr().err
    (path / "calibration.json").write_text('{"version": 2, "slots": [{"lo": [0.0], "p": [0.9], "n": [3]}]}')
    ev.main([*args, "--out", str(tmp_path / "with.json")])
    notes = [line for line in capsys.readouterr().err.splitlines() if "calibration.json" in line]
    assert notes == [f"note: {path / 'calibration.json'} is ignored: calibrated thresholds were removed "
                     "(docs/method.md §16)"]
    replies = [[json.loads(line)["reply"] for line in (tmp_path / f"{name}.samples.jsonl").read_text().splitlines()]
               for name in ("alone", "with")]
    assert replies[0] == replies[1]


# ---- batched decoding equals batch 1 ----

@pytest.fixture
def ckpt(tmp_path):
    # sharpen 20: confident, so thresholds accept several tokens
    model, tok = tiny_checkpoint(tmp_path / "ckpt", spread=0, sharpen=20)
    return tmp_path / "ckpt", model, tok


def test_batch_equals_single(ckpt, tmp_path):
    path, model, tok = ckpt
    items = [{"id": str(i), "prompt": p} for i, p in enumerate(["What is 2 + 2?", "Hi", "Sort: b a c", "x" * 30])]
    modes = ["ar", "0.5", "verify-tree", "verify-chain"]
    runs = {bs: ev.run(model, tok, items, ev.Settings(ckpt=str(path), modes=modes, batch_size=bs,
                                                        max_new_tokens=24)) for bs in (1, 3)}
    for mode in modes:
        assert [r["reply"] for r in runs[1][mode]] == [r["reply"] for r in runs[3][mode]]
        assert [r["forwards"] for r in runs[1][mode]] == [r["forwards"] for r in runs[3][mode]]
    # ar is plain greedy decoding, one token per forward; verify gives exactly its replies (§9).
    assert all(r["tokens"] == r["forwards"] for r in runs[1]["ar"])
    for mode in ("verify-tree", "verify-chain"):
        assert [r["reply"] for r in runs[3][mode]] == [r["reply"] for r in runs[3]["ar"]]
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    out, _ = decode(model, [ids], tok.mask_id, tok.stop_ids, Options(tau=1.0, max_new_tokens=24, cache="none"))
    assert runs[1]["ar"][1]["reply"] == tok.decode([t for t in out[0] if t not in tok.stop_ids])


def demo_data(path, n: int):
    # n demo-task rows ("What is a + 1?"), as mars/tasks.py writes them.
    path.write_text("".join(json.dumps({"family": "arithmetic", "answer": str(a + 1),
                                        "messages": [{"role": "user", "content": f"What is {a} + 1?"},
                                                     {"role": "assistant", "content": str(a + 1)}]}) + "\n"
                            for a in range(n)))
    return path


def test_summary_and_main_on_the_demo_task(ckpt, tmp_path, capsys):
    path, _, _ = ckpt
    data = demo_data(tmp_path / "test.jsonl", 5)
    out = tmp_path / "r.json"
    ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "0.5",
             "--max-new-tokens", "8", "--batch-size", "2", "--out", str(out)])
    summary = json.loads(out.read_text())
    assert set(summary) == {"ar", "0.5", "settings"}
    for mode in ("ar", "0.5"):
        assert set(summary[mode]) >= {"accuracy", "tokens_per_forward", "tokens_per_second", "speedup_vs_ar"}
        assert summary[mode]["problems"] == 5
    assert summary["ar"]["speedup_vs_ar"] == 1.0 and summary["ar"]["tokens_per_forward"] == 1.0
    samples = [json.loads(line) for line in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert len(samples) == 10 and {"prompt", "reply", "passed", "forwards"} <= set(samples[0])
    # A random model cannot answer: accuracy is what the samples' verdicts say.
    assert summary["ar"]["accuracy"] == 100 * sum(s["passed"] for s in samples if s["mode"] == "ar") / 5
    err = capsys.readouterr().err
    assert "was not MARS-trained" in err  # tau 0.5 on an untrained checkpoint
    # piped (not a terminal), progress comes as whole lines: the first batch's (30 s apart after it) and the last
    progress = [line for line in err.splitlines() if line.startswith("[eval] batch")]
    assert "\r" not in err and [p.split(" (")[0] for p in progress] == ["[eval] batch 1/3", "[eval] batch 3/3"]


def test_a_killed_eval_resumes_where_it_stopped(ckpt, tmp_path, monkeypatch):
    path, _, _ = ckpt
    data = demo_data(tmp_path / "test.jsonl", 7)
    args = ["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "0.5",
            "--max-new-tokens", "8", "--batch-size", "2"]
    real, calls, kill_at = ev.decode, [], [0]

    class Killed(BaseException):  # like KeyboardInterrupt, which pytest keeps for itself
        pass

    def counted(model, batch, *a, **kw):
        calls.append(len(batch))
        if len(calls) == kill_at[0]:
            raise Killed
        return real(model, batch, *a, **kw)

    monkeypatch.setattr(ev, "decode", counted)
    whole = tmp_path / "whole.json"
    ev.main(args + ["--out", str(whole), "--no-resume"])  # the reference: one unbroken run
    calls.clear()
    kill_at[0] = 5  # killed in the third batch's first mode
    cut = tmp_path / "cut.json"
    with pytest.raises(Killed):
        ev.main(args + ["--out", str(cut)])
    assert not cut.exists() and len(cut.with_suffix(".partial.jsonl").read_text().splitlines()) == 1 + 2
    calls.clear()
    ev.main(args + ["--out", str(cut)])
    assert calls == [2, 2, 1, 1]  # only batches 3 and 4 (of 2, 2, 2, 1 problems) were decoded
    assert not cut.with_suffix(".partial.jsonl").exists()

    def rows(out):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in out.with_suffix(".samples.jsonl").read_text().splitlines()]

    assert rows(cut) == rows(whole)
    a, b = json.loads(cut.read_text()), json.loads(whole.read_text())
    assert a["ar"]["accuracy"] == b["ar"]["accuracy"] and a["0.5"]["forwards"] == b["0.5"]["forwards"]
    # A partial file from other settings is never mixed in.
    header = {"settings": {"max_new_tokens": 4, "problems": "?"}}
    cut.with_suffix(".partial.jsonl").write_text(json.dumps(header) + "\n")
    with pytest.raises(SystemExit, match="other settings.*--max-new-tokens 4 there, 8 here"):
        ev.main(args + ["--out", str(cut)])
    # Nor one from other weights in the same folder (a model trained again there); device and dtype are
    # compared, and recorded, as they resolved.
    assert (b["settings"]["device"], b["settings"]["dtype"]) == ("cpu", "float32")
    calls.clear()
    kill_at[0] = 3
    with pytest.raises(Killed):
        ev.main(args + ["--out", str(cut), "--no-resume"])
    weights = path / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with pytest.raises(SystemExit, match="other settings \\(the checkpoint's weights changed since\\)"):
        ev.main(args + ["--out", str(cut)])
    # Nor one whose problems differ, although the --data path is the same (the file was written again).
    calls.clear()
    with pytest.raises(Killed):
        ev.main(args + ["--out", str(cut), "--no-resume"])
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    with pytest.raises(SystemExit, match=r"other settings \(the problems changed since \(the same --data path holds"):
        ev.main(args + ["--out", str(cut)])
    # A journal of an older eval.py, which keyed no problems, is named as such.
    cut.with_suffix(".partial.jsonl").write_text(json.dumps({"settings": {"max_new_tokens": 8}}) + "\n")
    with pytest.raises(SystemExit, match=r"partial.jsonl holds a killed run of an older eval.py, which this one"):
        ev.main(args + ["--out", str(cut)])
    # A header that is JSON but no journal's, and a torn one, are named with the way on.
    cut.with_suffix(".partial.jsonl").write_text(json.dumps({"settings": 5}) + "\n")
    with pytest.raises(SystemExit, match=r"partial.jsonl:1: not the header of a killed run's journal"):
        ev.main(args + ["--out", str(cut)])
    cut.with_suffix(".partial.jsonl").write_text('{"sett')
    with pytest.raises(SystemExit, match=r"partial.jsonl:1: not the header of a killed run's journal .*--no-resume"):
        ev.main(args + ["--out", str(cut)])


def test_scoring_runs_as_many_programs_at_once_as_this_process_has_cores(monkeypatch):
    # Under taskset or a container's CPU quota, fewer than the machine's: a program's --timeout is wall time.
    running, most, lock = [0], [0], threading.Lock()

    def score(task, item, reply, timeout, unsafe):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return True

    monkeypatch.setattr(ev, "score", score)
    for n in (1, 3):
        monkeypatch.setattr(ev, "cores", lambda n=n: n)
        most[0] = 0
        results = {"ar": [{"reply": "x"} for _ in range(9)]}
        ev.score_all(ev.Settings(task="humaneval"), [{}] * 9, results)
        assert most[0] == n and all(r["passed"] for r in results["ar"])


def test_piped_an_eval_says_how_far_it_is_inside_a_batch_and_while_it_scores(ckpt, tmp_path, monkeypatch, capsys):
    path, _, _ = ckpt
    data = demo_data(tmp_path / "test.jsonl", 3)
    monkeypatch.setattr(ev, "PROGRESS_S", 0.0)  # a line at every chance
    ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "--max-new-tokens", "4",
             "--batch-size", "2"])
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("[eval] batch 1/2, ar: ") and " tokens so far | elapsed " in line for line in err)
    assert [line.split(" |")[0] for line in err if line.startswith("[eval] scoring")] == [
        "[eval] scoring: 1/3 replies", "[eval] scoring: 2/3 replies", "[eval] scoring: 3/3 replies"]


def stopped_at_the_second_batch(monkeypatch, stop) -> list:
    # ev.decode, with stop() called as the second batch starts; -> the calls so far (clear it to count again).
    real, calls = ev.decode, []

    def decode(model, batch, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            stop()
        return real(model, batch, *a, **kw)

    monkeypatch.setattr(ev, "decode", decode)
    return calls


def test_ctrl_c_in_an_eval_says_the_same_command_goes_on(ckpt, tmp_path, monkeypatch, capsys):
    path, _, _ = ckpt
    data = demo_data(tmp_path / "test.jsonl", 4)

    def ctrl_c():
        raise KeyboardInterrupt

    calls = stopped_at_the_second_batch(monkeypatch, ctrl_c)
    out = tmp_path / "e.json"
    with pytest.raises(SystemExit) as e:
        ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "--max-new-tokens", "4",
                 "--batch-size", "2", "--out", str(out)])
    assert e.value.code == 130
    assert capsys.readouterr().err.endswith(f"\ninterrupted: the batches decoded so far are in "
                                            f"{out.with_suffix('.partial.jsonl')}; the same command goes on from "
                                            "them\n")
    calls.clear()
    with pytest.raises(SystemExit):
        ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar", "--max-new-tokens", "4",
                 "--batch-size", "2", "--out", str(out), "--no-resume"])
    assert "; the same command without --no-resume goes on from them" in capsys.readouterr().err


def test_sigterm_ends_an_eval_as_ctrl_c_does(ckpt, tmp_path, monkeypatch, capsys):
    # `timeout` and batch systems stop a run with SIGTERM: the same line on how to go on, status 130, and the
    # handler that was there before is back afterwards.
    import signal

    path, _, _ = ckpt
    data = demo_data(tmp_path / "test.jsonl", 4)
    stopped_at_the_second_batch(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "e.json"

    def unheard(signum, frame):  # the handler before main's: were it still there, the signal would end here
        raise AssertionError("SIGTERM reached the handler eval.py should have replaced")

    before = signal.signal(signal.SIGTERM, unheard)
    try:
        with pytest.raises(SystemExit) as e:
            ev.main(["--ckpt", str(path), "--task", "demo", "--data", str(data), "--modes", "ar",
                     "--max-new-tokens", "4", "--batch-size", "2", "--out", str(out)])
        assert e.value.code == 130 and signal.getsignal(signal.SIGTERM) is unheard
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "\ninterrupted: the batches decoded so far are in " in capsys.readouterr().err


def test_a_baseline_whose_samples_are_not_evals_is_named(tmp_path):
    summary = tmp_path / "base.json"
    summary.write_text("{}")
    ev.beside(summary, ".samples.jsonl").write_text(json.dumps({"mode": "ar", "id": "demo/0", "reply": "x",
                                                                "passed": True}) + "\n" + '{"mode": "ar"}\n')
    with pytest.raises(ValueError, match=re.escape("base.samples.jsonl:2: not a sample of eval.py")):
        ev.read_samples(summary, "ar")


def test_the_weights_key_of_an_adapter_run_covers_its_base(ckpt, tmp_path):
    # A resumed eval of a gated adapter run must notice its base trained again too, not only the adapter.
    from mars import adapter
    run = tmp_path / "run"
    run.mkdir()
    (run / adapter.WEIGHTS).write_bytes(b"adapter")
    (run / adapter.CONFIG).write_text(json.dumps({"type": "gated-lora", "base": str(ckpt[0]), "rank": 4, "alpha": 8,
                                                  "mask_id": 0}))
    before = ev.weights_key(run)
    assert ev.weights_key(ckpt[0])[0] in before[-1][2]
    weights = ckpt[0] / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert ev.weights_key(run) != before


def test_untrained_mask_warning(tmp_path, capsys):
    assert warn_untrained_masks(str(tmp_path), 0.9) and "--verify" in capsys.readouterr().err
    assert not warn_untrained_masks(str(tmp_path), 1.0)
    (tmp_path / "settings.json").write_text(json.dumps({"mode": "mars"}))
    assert not warn_untrained_masks(str(tmp_path), 0.9)
    (tmp_path / "settings.json").write_text(json.dumps({"mode": "ar"}))
    assert warn_untrained_masks(str(tmp_path), 0.9)
    (tmp_path / "config.json").write_text(json.dumps({"pard_token": 151665}))  # a published MARS checkpoint
    assert not warn_untrained_masks(str(tmp_path), 0.9)


# ---- self-distillation ----

def test_distill_prompts_are_disjoint_from_humaneval():
    prompts = distill.stdlib_prompts()
    assert len(prompts) > 200 and len({p["id"] for p in prompts}) == len(prompts)
    problems = ev.humaneval_problems()
    names = {p["entry_point"] for p in problems}
    for p in prompts:
        assert re.search(r"def (\w+)", p["prompt"]).group(1) not in names
        assert p["prompt"].startswith(ev.CODE_INSTRUCTION)  # the evaluation's own prompt style
    # No 8-word run of a HumanEval prompt appears in any distillation prompt.
    he = {tuple(w[i:i + 8]) for p in problems for w in [distill.words(p["prompt"])] for i in range(len(w) - 7)}
    for p in prompts:
        body = distill.words(p["prompt"].split("```python")[1])
        assert not any(tuple(body[i:i + 8]) in he for i in range(len(body) - 7)), p["id"]


def test_distill_source_chunks_are_disjoint_from_humaneval_and_framed_as_replies():
    rows = distill.source_rows(chunks_per_module=2, chunk_lines=30)
    assert len(rows) > 100
    problems = ev.humaneval_problems()
    he = {tuple(w[i:i + 8]) for p in problems for w in [distill.words(p["prompt"])] for i in range(len(w) - 7)}
    for r in rows:
        user, reply = r["messages"]
        assert user["role"] == "user" and reply["role"] == "assistant" and reply["content"].startswith("```python")
        assert not any(f"def {p['entry_point']}(" in reply["content"] for p in problems)
        body = distill.words(reply["content"])
        assert not any(tuple(body[i:i + 8]) in he for i in range(len(body) - 7)), user["content"]


def test_distill_writes_greedy_replies_and_resumes(ckpt, tmp_path, monkeypatch):
    path, model, tok = ckpt
    rows = [{"id": f"m.f{i}", "prompt": f"Write f{i}."} for i in range(5)]
    monkeypatch.setattr(distill, "stdlib_prompts", lambda: rows)
    out = tmp_path / "d" / "train.jsonl"
    args = ["--ckpt", str(path), "--out", str(out), "--dtype", "float32", "--max-new-tokens", "40", "--batch-size", "2"]
    distill.main(args + ["--limit", "3"])
    log = [json.loads(line) for line in out.with_suffix(".log.jsonl").read_text().splitlines()]
    assert [r["id"] for r in log] == ["m.f0", "m.f1", "m.f2"]
    distill.main(args)  # resumes: only the last two prompts are decoded
    log = [json.loads(line) for line in out.with_suffix(".log.jsonl").read_text().splitlines()]
    assert [r["id"] for r in log] == [f"m.f{i}" for i in range(5)]
    kept = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert len(kept) == sum(r["kept"] for r in log)
    # Every kept reply is the model's greedy reply, ended by EOS; cut replies are never kept.
    for r in log:
        ids = tok.encode_chat([{"role": "user", "content": f"Write {r['id'][2:]}."}], add_generation_prompt=True)
        o, _ = decode(model, [ids], tok.mask_id, tok.stop_ids, Options(tau=1.0, max_new_tokens=40, cache="none"))
        assert r["kept"] == (o[0][-1] in tok.stop_ids)
        if r["kept"]:
            assert {"role": "assistant", "content": tok.decode(o[0][:-1])} in [m[1] for m in kept]


# ---- paired comparison with a baseline, and the repeat rate per slot ----

def test_mcnemar_exact_p():
    from math import comb

    assert ev.mcnemar_p(0, 0) == 1.0 and ev.mcnemar_p(3, 3) == 1.0
    assert ev.mcnemar_p(0, 6) == pytest.approx(2 / 64)  # all six disagreements one way
    assert ev.mcnemar_p(1, 5) == ev.mcnemar_p(5, 1) == pytest.approx(2 * (comb(6, 0) + comb(6, 1)) / 64)


def test_paired_counts_difference_and_identical_replies():
    base = [{"id": str(i), "passed": p, "reply": f"r{i}"} for i, p in enumerate([1, 1, 1, 0, 0, 1])]
    new = [{"id": str(i), "passed": p, "reply": f"r{i}" if i < 3 else "other"}
           for i, p in enumerate([1, 0, 1, 1, 0, 1])]
    got = ev.paired(base, new[::-1])  # matched by id, not by order
    assert (got["both"], got["only_baseline"], got["only_new"], got["neither"]) == (3, 1, 1, 1)
    assert got["difference"] == 0.0 and got["identical_replies"] == 0.5
    d = [0, -1, 0, 1, 0, 0]  # new - base per problem
    assert got["difference_se"] == pytest.approx(100 * (sum(x * x for x in d) / 5 / 6) ** 0.5)
    with pytest.raises(ValueError, match="different problems"):
        ev.paired(base, new[:4])


def test_slot_counter_counts_repeats_of_the_token_before():
    slots = [[[0, 0] for _ in range(3)] for _ in range(2)]
    count = ev.slot_counter(slots, [[5, 7], [9]])
    count(0, [7, 7, 8])  # slot 0 repeats the prompt's last token, slot 1 repeats slot 0
    count(1, [4])
    count(0, [8, 1])  # slot 0 repeats the last step's last token
    assert slots[0] == [[2, 2], [2, 1], [1, 0]] and slots[1] == [[1, 0], [0, 0], [0, 0]]


def test_main_compares_with_a_baseline_run(ckpt, tmp_path, capsys):
    path, _, _ = ckpt
    data = demo_data(tmp_path / "test.jsonl", 4)
    common = ["--ckpt", str(path), "--task", "demo", "--data", str(data), "--max-new-tokens", "8",
              "--batch-size", "2"]
    ev.main([*common, "--modes", "ar", "--out", str(tmp_path / "base.json")])
    ev.main([*common, "--modes", "ar", "0.5", "--out", str(tmp_path / "new.json"),
             "--baseline", str(tmp_path / "base.json")])
    summary = json.loads((tmp_path / "new.json").read_text())
    same = summary["ar"]["paired_vs_baseline"]
    assert same["identical_replies"] == 1.0 and same["difference"] == 0.0 and same["mcnemar_p"] == 1.0
    assert summary["0.5"]["paired_vs_baseline"]["problems"] == 4
    assert sum(summary["0.5"]["slot_accepts"]) == summary["0.5"]["new_tokens"]
    assert len(summary["ar"]["slot_accepts"]) == 1 and len(summary["0.5"]["slot_accepts"]) == 4
    # a baseline over other problems, or without the mode asked for, or cut at another length, is refused
    # before decoding
    other = tmp_path / "other.jsonl"
    other.write_text("".join(line.replace("What is", "So what is") + "\n" for line in data.read_text().splitlines()))
    for extra, message in ((["--limit", "2"], "compare runs over the same --limit"),
                           (["--baseline-mode", "0.9"], "no mode '0.9'"),
                           (["--data", str(other)], "its problems have other prompts than this run's"),
                           (["--max-new-tokens", "6"], "cut at --max-new-tokens 8, this run's at 6")):
        with pytest.raises(SystemExit, match=message):
            ev.main([*common, "--modes", "ar", "--baseline", str(tmp_path / "base.json"), *extra])


def test_a_bad_out_is_refused_before_the_model_loads(ckpt, tmp_path, monkeypatch, capsys):
    path, _, _ = ckpt
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    pipe, link = tmp_path / "pipe", tmp_path / "link.json"
    os.mkfifo(pipe)  # as /dev/null or /dev/stdout would be: replaced by a plain file, were it written
    link.symlink_to(blocker)
    for out, message in ((tmp_path, "is a folder; give a file name in it"),
                         (blocker / "sub" / "r.json", "cannot be written"),
                         (pipe, "is a link or not a plain file"), (link, "is a link or not a plain file")):
        with pytest.raises(SystemExit) as e:
            ev.main(["--ckpt", str(path), "--task", "demo", "--modes", "ar", "--out", str(out)])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert pipe.is_fifo() and link.is_symlink()


def test_the_files_beside_the_summary_keep_its_whole_name():
    # --out tau0.9 and --out tau0.5 must not share tau0.samples.jsonl (nor its partial file)
    assert ev.beside(Path("r/run.json"), ".samples.jsonl") == Path("r/run.samples.jsonl")
    assert ev.beside(Path("r/tau0.9"), ".samples.jsonl") == Path("r/tau0.9.samples.jsonl")
    assert ev.beside(Path("r/qwen2.5-0.5b"), ".partial.jsonl") == Path("r/qwen2.5-0.5b.partial.jsonl")


def test_ckpt_defaults_to_the_demo_model_and_bad_flags_are_usage_errors(tmp_path, monkeypatch, capsys):
    from mars import prompts, serve
    assert ev.Settings().ckpt == prompts.Settings().ckpt == serve.Settings().ckpt == DEFAULT_CKPT  # generate.py's
    monkeypatch.chdir(tmp_path)  # no runs/demo/mars here
    with pytest.raises(SystemExit, match="no checkpoint at runs/demo/mars: run `make demo` first"):
        ev.main(["--task", "demo", "--modes", "ar"])
    for flags, message in ((["--modes", "ar", "fast"], "--modes fast: use ar, verify"),
                           (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
                           (["--limit", "-1"], "--limit -1 must be at least 0"),
                           (["--timeout", "0"], "--timeout 0.0 must be a number of seconds > 0"),
                           (["--timeout", "1e20"], "--timeout 1e+20 must be a number of seconds > 0, at most 3600"),
                           (["--device", "tpu"], "--device tpu: choose auto, cpu, cuda or cuda:N"),
                           (["--modes", "ar", "verify", "ar"], "--modes names ar twice; name each mode once"),
                           (["--modes", "-0.9"], "--modes -0.9: use ar, verify"),
                           (["--task", "humaneval", "--data", "x.jsonl"], "--data x.jsonl: --task humaneval reads")):
        with pytest.raises(SystemExit) as e:
            ev.main(["--task", "demo", *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and f"error: {message}" in err, err


def test_a_demo_file_of_other_rows_or_none_is_named(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"question": "1+1?", "answer": "#### 2"}\n')  # a gsm8k row
    with pytest.raises(ValueError, match=f"{re.escape(str(f))}:1: not a demo task row; pass a test file"):
        ev.load_task(ev.Settings(task="demo", data=str(f)))
    f.write_text("")
    with pytest.raises(SystemExit, match=f"--task demo --data {re.escape(str(f))}: no problems to evaluate"):
        ev.main(["--task", "demo", "--data", str(f), "--ckpt", str(tiny_ckpt(tmp_path)), "--modes", "ar"])


def tiny_ckpt(tmp_path):
    tiny_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_limit_stops_reading_the_data_file(tmp_path):
    # A file whose third line is broken: --limit 2 never reads that far.
    f = tmp_path / "gsm.jsonl"
    f.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"}\n{broken\n')
    items = ev.load_task(ev.Settings(task="gsm8k", data=str(f), limit=2))
    assert [it["reference"] for it in items] == ["2", "4"]
    with pytest.raises(ValueError, match="not valid JSON"):
        ev.load_task(ev.Settings(task="gsm8k", data=str(f)))
