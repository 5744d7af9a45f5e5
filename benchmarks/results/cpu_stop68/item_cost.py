#!/usr/bin/env python
"""Stop 68: what one small piece of host work costs right after a pass over 16 MB (the state the guard's Python runs
in after the optimizer's kernel): an empty Python function, a 0-d tensor's ``.item()``, and the same float read
through ``ctypes`` at its ``data_ptr()``, each after its own pass, 3000 times in turn (thread clock and wall clock).
Run::

    OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop68/item_cost.py
"""
import ctypes
import statistics
import time

import torch

big = torch.randn(4_000_000)
s = torch.full((), 65536.0)
_cf = ctypes.c_float.from_address


def item() -> float:
    return s.item()


def ctypes_read() -> float:
    return _cf(s.data_ptr()).value


def empty() -> None:
    return None


for clock_name, clock in (("thread", time.thread_time_ns), ("wall", time.perf_counter_ns)):
    times: dict[str, list[int]] = {f.__name__: [] for f in (item, ctypes_read, empty)}
    for _ in range(3000):
        for f in (item, ctypes_read, empty):
            big.mul_(1.0)
            t = clock()
            f()
            times[f.__name__].append(clock() - t)
    for name, ts in times.items():
        p25, med, p75 = statistics.quantiles(ts, n=4)
        print(f"{clock_name} clock, {name}: median {med / 1e3:.1f} us (p25 {p25 / 1e3:.1f}, p75 {p75 / 1e3:.1f})")
