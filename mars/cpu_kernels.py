# The CPU kernels of mars/cpu_kernels.cpp, for decode steps: built with the system's C++ compiler on first use
# (a second or so) for the CPU's instruction set, and called through ctypes. Both are opt-in speed: where
# they cannot run, the callers keep torch's path, which stays the reference.
#   int4_mm: y = x W^T + b for int4 weights, the kernel of --quantize int4 (mars/quantize.py); AVX-512 BF16
#            or AVX2 with FMA
#   lowrank_add: a gated adapter's low-rank update at a decode step's mask rows (mars/adapter.py), for a
#                bfloat16 model, in place of several hundred small float32 matmuls a forward; AVX-512 BF16
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

GROUP = 32  # int4_mm: one scale and zero per 32 inputs (mars/quantize.py GROUP_SIZE)
BLOCK = 32  # int4_mm packs output channels 32 at a time

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC"]
# The builds, fastest first: a readable name, the CPU flags each needs and its compiler flags.
# MARS_CPU_KERNELS=NAME picks one (a benchmark of the AVX2 build on an AVX-512 CPU, say).
BUILDS = {"avx512bf16": ("AVX-512 BF16", {"avx512bw", "avx512vl", "avx512_bf16"},
                         ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]),
          "avx2": ("AVX2 with FMA", {"avx2", "fma"}, ["-mavx2", "-mfma"])}


def cpu_flags() -> set[str]:
    try:
        return {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()[2:]}
    except OSError:  # not Linux: no flags read, so torch's kernel
        return set()


def builds_for_this_cpu() -> tuple[list[str], str]:
    # -> (the builds this CPU runs, fastest first, or the one MARS_CPU_KERNELS names; "") or ([], why none)
    name = os.environ.get("MARS_CPU_KERNELS") or None
    if name is not None and name not in BUILDS:
        return [], f"MARS_CPU_KERNELS={name}: choose one of {', '.join(BUILDS)}"
    have = cpu_flags()
    runs = [b for b, (_, needs, _) in BUILDS.items() if name in (None, b) and needs <= have]
    wanted = BUILDS[name][0] if name else "AVX-512 BF16, nor AVX2 with FMA"
    return runs, "" if runs else f"this CPU has no {wanted}"


@cache
def kernels() -> tuple[ctypes.CDLL | None, str]:
    # -> (the library of mars/cpu_kernels.cpp, "") or (None, why it cannot run here): the first build this CPU
    # runs that compiles (a compiler too old for -mavx512bf16 still builds AVX2's). The library's `build` is
    # its name in BUILDS.
    names, why = builds_for_this_cpu()
    first = why
    for name in names:
        library, why = load(name)
        if library is not None:
            if first:  # a faster build failed: said, since this one is slower (and sets int4's --dtype auto)
                print(f"note: {first}; the {BUILDS[name][0]} build runs instead", file=sys.stderr)
            return library, ""
        first = first or why
    return None, first


def load(name: str) -> tuple[ctypes.CDLL | None, str]:
    # One build, compiled once per source, compiler and flags into ~/.cache/mars (or $XDG_CACHE_HOME/mars),
    # written under a temporary name and renamed, so a build cut short or two processes building at once
    # leave no broken library; a cached library that does not load (a damaged file) is built again, once.
    compiler, flags = os.environ.get("CXX") or "c++", FLAGS + BUILDS[name][2]  # CXX may be "ccache g++"
    try:
        command = shlex.split(compiler)
    except ValueError as e:  # an unbalanced quote
        return None, f"CXX={compiler!r} is not a command ({e})"
    if not command or shutil.which(command[0]) is None:
        return None, f"no C++ compiler ({compiler}) to build mars/cpu_kernels.cpp; install g++ or set CXX"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mars"
    lib = cache_dir / f"cpu_kernels-{name}-{key}.so"
    for attempt in (1, 2):
        try:  # a cache that cannot be written, a library that does not load: torch's path, with the reason
            if not lib.exists() and (why := build(compiler, command, flags, name, lib)):
                return None, why
            library = ctypes.CDLL(str(lib))
            break
        except OSError as e:  # a damaged file is built again; a folder that may not run code (noexec) is not
            damaged = lib.exists() and (lib.stat().st_size == 0 or any(w in str(e) for w in ("ELF", "too short")))
            if attempt == 2 or not damaged:
                return None, f"mars/cpu_kernels.cpp: {e}"
            print(f"note: {lib} does not load ({e}); building it again", file=sys.stderr)
            try:
                lib.unlink()
            except OSError:
                return None, f"mars/cpu_kernels.cpp: {e}"
    p, i = ctypes.c_void_p, ctypes.c_int
    library.mars_int4_mm.argtypes = [p, i, p, p, p, i, i, i, i]
    if has_lowrank(library):
        library.mars_lowrank_add.argtypes = [p, p, p, p, p, i, i, i, i, i]
    library.build = name
    return library, ""


def build(compiler: str, command: list[str], flags: list[str], name: str, lib: Path) -> str:
    # Compiles the library `lib` with command (CXX, split) -> "" or why the compiler could not. Readable by every
    # user (a shared cache).
    print(f"note: building mars/cpu_kernels.cpp ({BUILDS[name][0]}) into {lib.parent} (once per version)",
          file=sys.stderr)
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        done = subprocess.run([*command, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:  # the line that says why: not collect2's "ld returned 1 exit status"
            lines = done.stderr.strip().splitlines() or ["?"]
            first = next((line for line in lines if ("error" in line or "cannot find" in line)
                          and not line.startswith("collect2")), lines[0])
            return f"{compiler} could not build mars/cpu_kernels.cpp ({BUILDS[name][0]}): {first}"
        os.chmod(tmp, 0o755)  # after the link: some linkers write a new file, with mkstemp's 0600 or the umask's
        os.replace(tmp, lib)
        return ""
    finally:  # a failed build leaves no half-written library (a failed link has removed it already)
        Path(tmp).unlink(missing_ok=True)


def has_lowrank(library: ctypes.CDLL | None) -> bool:  # whether the build has mars_lowrank_add (AVX-512 BF16)
    return library is not None and hasattr(library, "mars_lowrank_add")


def loaded_build() -> str | None:  # the build the kernels run here, by its name in BUILDS
    return getattr(kernels()[0], "build", None)


def pack_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    # q (N, K) in [0, 15], scales_and_zeros (K / 32, N, 2) bf16, N a multiple of 32 -> the bytes
    # mars/cpu_kernels.cpp reads, (N / 32, K / 32, 640) uint8; its header comment describes the layout.
    N, K = q.shape
    blocks, groups = N // BLOCK, K // GROUP
    # (block, half, channel, group, pair, input of the pair) -> (block, group, pair, half, channel, input)
    codes = q.to(torch.uint8).view(blocks, 2, 16, groups, GROUP // 2, 2)
    codes = codes.permute(0, 3, 4, 1, 2, 5).reshape(blocks, groups, GROUP // 2, 2, 2 * 16)
    codes = codes[..., 0, :] | (codes[..., 1, :] << 4)  # channels 0-15 low, 16-31 high
    s, z = (scales_and_zeros[..., i].view(groups, blocks, BLOCK).transpose(0, 1).contiguous().view(torch.uint8)
            for i in (0, 1))  # (blocks, groups, 64): 32 bf16 each
    return torch.cat([s, z, codes.reshape(blocks, groups, -1)], -1).contiguous()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    # x (rows, K) float32 or bf16 -> x W^T + bias (rows, n) in x's dtype, by mars/cpu_kernels.cpp; packed
    # from pack_int4 (n rounded up to 32 channels). The kernel reads raw memory: the checks are here (each a
    # tensor attribute: a decode step makes about 170 of these calls).
    if not (x.is_cpu and packed.is_cpu) or x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"mars/cpu_kernels.cpp takes float32 or bfloat16 activations on the CPU, not {x.dtype} on "
                        f"{x.device}; a model quantized with int4 stays on the CPU")
    K = x.shape[1]
    size = -(-n // BLOCK) * BLOCK * K * 20 // 32  # 640 bytes per 32 x 32 weights
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.numel() != size or K % GROUP \
            or (bias is not None and (bias.shape != (n,) or not bias.is_contiguous())):
        raise ValueError(f"int4_mm: {tuple(packed.shape)} {packed.dtype} is not pack_int4's bytes for {n} x {K} "
                         "(K a multiple of 32), or the bias is not (n,)")
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and bias.dtype != torch.float32:  # a model cast after quantizing
        bias = bias.float()
    y = x.new_empty(x.shape[0], n)
    if kernels()[0].mars_int4_mm(x.data_ptr(), x.dtype == torch.bfloat16, packed.data_ptr(),
                                 None if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0], n, K,
                                 torch.get_num_threads()):
        raise MemoryError("mars/cpu_kernels.cpp: out of memory for the activations' copy")
    return y


# The same as an operator torch.compile can trace around (an eager call skips the dispatcher's cost)
compiled_int4_mm = torch.library.custom_op("mars::int4_mm", mutates_args=())(int4_mm)
compiled_int4_mm.register_fake(lambda x, packed, bias, n: x.new_empty(x.shape[0], n))


def lowrank_add(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> None:
    # y[m] += (A x[m]) Bt gate[m], in place, at the rows whose gate is not 0: x (M, K), A (r, K), Bt (r, N),
    # y (M, N) bf16 on the CPU, contiguous; gate (M,) float32. The kernel reads raw memory: the checks are here.
    (M, K), (r, N) = x.shape, Bt.shape
    tensors = (x, A, Bt, y)
    if not (all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.is_cpu for t in tensors)
            and gate.dtype == torch.float32 and gate.is_contiguous() and gate.shape == (M,)
            and A.shape == (r, K) and y.shape == (M, N) and K % 32 == 0):
        raise ValueError("lowrank_add: x (M, K), A (r, K), Bt (r, N), y (M, N) contiguous bf16 on the CPU, K a "
                         "multiple of 32, gate (M,) float32")
    if not has_lowrank(kernels()[0]):
        raise RuntimeError("lowrank_add: only mars/cpu_kernels.cpp's AVX-512 BF16 build has it (see has_lowrank)")
    if kernels()[0].mars_lowrank_add(x.data_ptr(), A.data_ptr(), Bt.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                     M, K, N, r, torch.get_num_threads()):
        raise MemoryError("mars/cpu_kernels.cpp: out of memory for a low-rank update")
