"""One thread for a small call, on the calling OS thread only.

A ViT call with little arithmetic (ONE_THREAD_MAX_FLOPS) is about a hundred small operators; after a pause a second
thread only adds waiting: its worker has gone to sleep, every parallel region waits for it, and on the VMs measured
it comes back slowly, for milliseconds in all (docs/benchmarks.md, "Small calls on one thread").

`torch.set_num_threads` is the wrong switch for one call: besides the calling thread's OpenMP and MKL counts it
sets a process-wide count that every thread starting to use torch meanwhile takes for good, and it empties oneDNN's
cache of computations. OpenMP's `omp_set_num_threads` and MKL's `MKL_Set_Num_Threads_Local` set the calling thread's
counts alone, and torch's CPU operators read exactly those (`torch.get_num_threads()` is OpenMP's count of the
calling thread). `one_thread_here` calls them through ctypes, in the runtimes torch itself loaded, and checks that
they act (torch must then report one thread); where they are not found it yields False and changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from vitlab.models.attention_core import route_threads_pinned

# A ViT call with up to this much arithmetic (forward FLOPs of all its images: 2 x registry.analytic_macs x images)
# runs on one thread. Back to back, such calls run about as fast on one thread as on two; from about 94 MFLOP on
# two are faster there; after a pause of 20 ms or more one thread is 3.7-4.5x faster at the Fashion-MNIST ViT's
# batch 1. The rule depends on the input's shape alone, so a call's logits never depend on how long it waited.
# Measured with `python benchmarks/overhead.py --small-calls` (docs/results/overhead_small_calls*.txt;
# docs/benchmarks.md, "Small calls on one thread").
ONE_THREAD_MAX_FLOPS = 64e6


class _Setters(NamedTuple):
    set_openmp: ctypes._CFuncPtr  # omp_set_num_threads(int): the calling thread's count
    get_openmp: ctypes._CFuncPtr  # omp_get_max_threads()
    set_mkl_local: ctypes._CFuncPtr | None  # MKL_Set_Num_Threads_Local(int) -> the previous local count (0: none)


def _libraries() -> Iterator[ctypes.CDLL]:
    """The process's global symbols, then the libraries in torch's own folder that may hold its OpenMP runtime and
    MKL (opening one that torch loaded gives that same library)."""
    if sys.platform != "win32":
        yield ctypes.CDLL(None)
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith(("libgomp", "libiomp", "libomp", "libtorch_cpu")):
            try:
                yield ctypes.CDLL(os.path.join(folder, name))
            except OSError:
                continue


def _functions(library: ctypes.CDLL, names: tuple[str, str], restype) -> tuple | None:
    """(setter, getter) of a thread count in `library`, or None where it has not both."""
    setter, getter = (getattr(library, name, None) for name in names)
    if setter is None or getter is None:
        return None
    setter.restype, setter.argtypes = restype, [ctypes.c_int]
    getter.restype, getter.argtypes = ctypes.c_int, []
    return setter, getter


def _acting(names: tuple[str, str], restype, reads: Callable[[], int] | None = None) -> tuple | None:
    """The first (setter, getter) whose setting the calling thread then reads back, through `reads` (torch's own
    count, for OpenMP: the runtime torch uses, not another one in the process) or the getter; set back at once."""
    for library in _libraries():
        found = _functions(library, names, restype)
        if found is None:
            continue
        setter, getter = found
        read = reads or getter
        before = getter()
        previous = setter(before + 1)
        acts = read() == before + 1
        setter(before if restype is None else previous)
        if acts:
            return setter, getter
    return None


@functools.cache
def _setters() -> _Setters | None:
    """The per-thread switches of torch's OpenMP runtime and MKL, checked to act; None where they are not found
    or do not act (another threading runtime)."""
    try:
        openmp = _acting(("omp_set_num_threads", "omp_get_max_threads"), None, torch.get_num_threads)
        mkl = _acting(("MKL_Set_Num_Threads_Local", "MKL_Get_Max_Threads"), ctypes.c_int)
    except (OSError, AttributeError):
        return None
    if openmp is None or (mkl is None and torch.backends.mkl.is_available()):
        return None
    return _Setters(openmp[0], openmp[1], mkl[0] if mkl else None)


@contextlib.contextmanager
def one_thread_here() -> Iterator[bool]:
    """torch's CPU operators on one thread in this block, on the calling OS thread only: other threads, and
    threads that start using torch meanwhile, keep their counts. Yields whether it did so (False where torch's
    runtimes offer no per-thread count: nothing changed)."""
    setters = _setters()
    if setters is None:
        yield False
        return
    threads = setters.get_openmp()
    setters.set_openmp(1)
    mkl_before = setters.set_mkl_local(1) if setters.set_mkl_local is not None else None
    try:
        yield True
    finally:
        setters.set_openmp(threads)
        if mkl_before is not None:
            setters.set_mkl_local(mkl_before)  # 0: the thread had no count of its own, and has none again


@contextlib.contextmanager
def one_thread(process_wide_fallback: bool = True) -> Iterator[bool]:
    """A small call's block: torch's operators on one thread (`one_thread_here`), the attention route kept the
    caller's (attention_core.route_threads_pinned): with it, the models measured give the caller's logits to the
    last bit wherever the route is the explicit one (up to 80 tokens; tests/test_engine_small_calls.py); torch's
    fused attention kernel may round differently on one thread, in the last bits. Where torch's runtimes offer no
    per-thread count, `process_wide_fallback` sets `torch.set_num_threads(1)` for the block (a thread that first
    runs torch meanwhile keeps one thread for good); without it nothing changes. Yields whether the block runs on
    one thread."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield True
        return
    with route_threads_pinned(threads), one_thread_here() as here:
        if here or not process_wide_fallback:
            yield here
            return
        torch.set_num_threads(1)
        try:
            yield True
        finally:
            torch.set_num_threads(threads)
