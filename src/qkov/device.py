"""Where to compute: the one place a device name becomes a ``torch.device``; and the process-wide
settings that make CPU results reproducible: :func:`reproducible_blas` and :func:`settle_vector_math`
(applied when qkov is imported) and :func:`flush_denormals` (in every thread, when training starts)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import torch

from .errors import QkovError

__all__ = [
    "check_fits",
    "flush_denormals",
    "free_memory",
    "memory_budget",
    "peak_resident",
    "pick_device",
    "reproducible_blas",
    "set_memory_budget",
    "tune_allocator_for",
    "tune_cpu_allocator",
]


def pick_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` -> ``cuda`` if a CUDA GPU is available, else ``cpu``; otherwise the named device.

    Raises:
        QkovError: the name is unknown, or names a device this machine does not have.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise QkovError(f"device: unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QkovError("device: cuda requested but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise QkovError(f"device: {name} requested but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise QkovError(f"device: unsupported device {name!r}")
    return dev


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take on ``device`` now: free GPU memory, or the kernel's
    ``MemAvailable`` (Linux) for the CPU; ``None`` where it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # the driver's view: torch's cached blocks count as used
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return _proc_kib("/proc/meminfo", "MemAvailable:") if device.type == "cpu" else None


def peak_resident() -> int | None:
    """This process's peak resident memory in bytes since it started: the kernel's ``VmHWM`` (Linux; it counts
    pages of memory-mapped files while they are mapped in); ``None`` where it cannot be read."""
    return _proc_kib("/proc/self/status", "VmHWM:")


def _proc_kib(path: str, key: str) -> int | None:
    """The kB figure of the line starting ``key`` in a ``/proc`` file, in bytes; ``None`` where it cannot be read."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_budget: int | None = None  # bytes an analysis may allocate at most (set_memory_budget): a cap below free memory


def set_memory_budget(nbytes: int | None) -> None:
    """Cap what analyses may allocate (``None``: free memory alone decides). The CLI's ``--max-memory``."""
    global _budget
    if nbytes is not None and nbytes <= 0:
        raise QkovError(f"the memory budget must be positive, got {nbytes}")
    _budget = nbytes


def memory_budget(device: torch.device) -> tuple[int | None, str]:
    """What an analysis may allocate on ``device``: the smaller of :func:`free_memory` and the budget
    set by :func:`set_memory_budget`, and which one it is (``"free"`` or ``"budget"``)."""
    free = free_memory(device)
    if _budget is not None and (free is None or _budget < free):
        return _budget, "budget"
    return free, "free"


def check_fits(
    need: int, device: torch.device, what: str, advice: str, *, hint: str | None = None, budget: bool = True
) -> None:
    """Refuse, before the work starts, work that needs more memory than :func:`memory_budget` allows
    (``budget=False``: than free memory alone, for what holds a model rather than an analysis's work).

    Raises:
        QkovError: ``need`` bytes exceed free memory or the budget (with ``hint``: what to reduce).
    """
    have, kind = memory_budget(device) if budget else (free_memory(device), "free")
    if have is not None and need > have:
        limit = f"the {_size(have)} free" if kind == "free" else f"the {_size(have)} memory budget"
        raise QkovError(f"{what} needs about {_size(need)}, more than {limit}: {advice}", hint=hint)


def _size(n: int) -> str:
    if n >= 2**40:
        return f"{n / 2**40:.1f} TiB"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@functools.cache  # the settings are the process's: once is enough, and a hot loop may call it freely
def tune_cpu_allocator() -> None:
    """Keep freed memory in the process (glibc) instead of returning it to the OS.

    Training allocates the same large buffers every step, and circuit discovery every pass;
    with glibc's defaults each one is a fresh mmap whose pages fault in again (measured:
    ~20% of a CPU training step; edge attribution on 64 GPT-2-small prompt pairs went from
    1.6 million page faults a call to 0.19 million). Training calls it, and analyses of a model held in
    memory through :func:`tune_allocator_for`; it changes the whole process's allocator, once. A no-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve up to 1 GiB from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB free at the top
    except (OSError, AttributeError):
        pass


def tune_allocator_for(source: object) -> None:
    """:func:`tune_cpu_allocator` for work on a weights ``source`` held in memory (``source.in_memory``), so
    each pass's large buffers are reused, not faulted in afresh; nothing for a streamed source, whose
    weights, read anew in many sizes each pass, would grow the kept heap."""
    if getattr(source, "in_memory", False):
        tune_cpu_allocator()


# MKL's conditional numerical reproducibility (CNR) settings, as its mkl_cbwr.h names them
_CBWR_ALL, _CBWR_BRANCH_OFF, _CBWR_AUTO = ~0, 1, 2


def _mkl_cnr_functions() -> tuple[Callable[[int], int], Callable[[int], int]] | None:
    """MKL's CNR getter and setter (``mkl_serv_cbwr_get``, ``mkl_serv_cbwr_set``, which torch's
    library exports), or ``None`` where torch has no MKL or does not export them."""
    if not torch.backends.mkl.is_available():
        return None
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        if not (lib_dir / name).is_file():
            continue
        try:
            lib = ctypes.CDLL(str(lib_dir / name))  # the library torch has loaded already
            get, set_ = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
        except (OSError, AttributeError):
            return None
        get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
        set_.argtypes, set_.restype = [ctypes.c_int], ctypes.c_int
        return get, set_
    return None


def reproducible_blas() -> bool | None:
    """Put MKL, torch's CPU BLAS on x86, in its reproducible mode (CNR, branch ``AUTO``), unless the
    environment chose a mode (``MKL_CBWR``); qkov calls this when it is imported.

    Every float32 matrix product of training and analysis on a CPU is an MKL ``sgemm``, and MKL
    promises bitwise equal results from one run to the next (on the same CPU and thread count)
    only in a CNR mode, which is off by default: without it, a resumed run could part from the
    uninterrupted one in the last bits, and then everywhere. ``AUTO`` keeps MKL's fastest code
    path for the CPU. MKL takes the setting only before its first computation in the process.

    Returns:
        ``True`` when MKL computes in a CNR mode; ``False`` when it does not and it is too late
        (MKL computed in this process before qkov was imported); ``None`` without MKL (ARM,
        macOS: other BLAS libraries, nothing to set).
    """
    funcs = _mkl_cnr_functions()
    if funcs is None:
        return None
    get, set_ = funcs
    if get(_CBWR_ALL) != _CBWR_BRANCH_OFF:  # MKL_CBWR in the environment, or already set
        return True
    return set_(_CBWR_AUTO) == 0  # MKL refuses a change once it has computed


VECTOR_MATH = (
    "abs", "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
"""The float unary operations torch computes with MKL's vector math (VML) on an x86 CPU."""


def settle_vector_math() -> bool:
    """Call each of MKL's vector-math functions torch uses (:data:`VECTOR_MATH`, float32 and float64)
    once, on one element, on this thread; qkov calls this when it is imported, and training again.

    MKL picks the kernel of each vector-math function (instruction set, accuracy) on that function's
    first call. torch computes ``exp``, ``log``, ``sqrt``... of a large tensor by splitting it between
    its threads, each calling MKL on its part; when that first call comes from two threads at once,
    MKL 2024.2 (the one torch 2.x wheels carry) can run one thread's part with its low-accuracy AVX2
    kernel, ``VML_EP``, although ``VML_HA`` is asked for (errors up to ~2000 units in the last place).
    Measured here: the first ``exp`` of a training process, in the first step's loss, now and then
    took that kernel for the second thread's half, and the whole run then differed from the others
    in its last bits; a resumed process's first step the same. A first call on one element, on one
    thread, settles every kernel before anything runs in parallel; later calls are unchanged.

    Returns:
        ``True`` when the calls were made; ``False`` without MKL (nothing to settle).
    """
    if not torch.backends.mkl.is_available():
        return False
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)
            for name in VECTOR_MATH:
                getattr(torch, name)(x)
    return True


_SET_IN_THREAD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_SET_IN_THREAD
def _flush_in_this_thread(_data: object) -> None:
    torch.set_flush_denormal(True)


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch computes with (the ``libgomp`` it loaded), or ``None`` (not Linux, not found)."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "libgomp" in line and "/" in line}
    except OSError:
        return None
    torch_dir = Path(torch.__file__).parent
    own = (str(torch_dir) + "/", str(torch_dir) + ".libs/")  # the wheel's lib/ or its auditwheel folder
    mine = sorted(p for p in paths if p.startswith(own)) or sorted(paths)
    try:
        return ctypes.CDLL(mine[0]) if mine else None
    except OSError:
        return None


def flush_denormals() -> None:
    """Flush denormal floats to zero in this thread and in every thread of torch's CPU pool.

    Denormals (|x| < 1.2e-38, from overconfident softmaxes late in training) run ~20x slower on
    x86. ``torch.set_flush_denormal`` sets only the calling thread's floating-point control, and
    torch's OpenMP worker threads copy it only when they start after it: in a process that ran
    parallel torch work before (a notebook), the workers would keep denormals while the main thread
    flushes them, and the same training would compute differently there than under ``qkov train``.
    This also sets it once in each worker (one OpenMP parallel region of torch's own runtime).
    """
    torch.set_flush_denormal(True)
    threads = torch.get_num_threads()
    gomp = _openmp_runtime() if threads > 1 else None
    try:
        parallel = gomp.GOMP_parallel if gomp is not None else None
    except AttributeError:  # another OpenMP runtime
        parallel = None
    if parallel is not None:
        parallel.argtypes = [_SET_IN_THREAD, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        parallel.restype = None
        parallel(_flush_in_this_thread, None, threads, 0)


reproducible_blas()  # when qkov is imported: before the process computes, if qkov comes first
settle_vector_math()  # before anything computes in parallel
