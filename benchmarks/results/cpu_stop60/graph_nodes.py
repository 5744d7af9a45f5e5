"""Stop 60: what a CUDA graph's host-visible nodes cost the host's replay() call. Stop 59's early skip flag (two
device-to-host copy nodes into pinned memory and two external event record nodes added to the step graph) put
+53 us into guard._measure on an H100 although the landing's fill had become one memmove (host_time.py, MLP
foreach). Here: a chain of K small kernels on a 60-float tensor (the step graph's decision is ~70), captured as
the guard captures (ampguard.decision_graph.captured), in variants:
  kernels        the chain alone
  +copy          a device-to-host copy of the result into pinned memory at the end (a memcpy node)
  +event         an external event recorded at the end (an event record node)
  +copy+event    both at the end (the landing)
  early          a 1-byte copy and an event in the middle, a 60-float copy and an event at the end (stop 59's early arm)
  mapped         the flag and the payload written by kernels straight into mapped pinned memory (a CUDA view of a
                 pinned host buffer through __cuda_array_interface__: no memcpy node, no event), the flag polled
For each: the host time of graph.replay() with the device drained before it (median, p25, p75 of N reps), and the
time from the replay's start to the flag in hand (event.synchronize, or the mapped byte polled). Run on the device:
PYTHONPATH=$PWD python benchmarks/results/cpu_stop60/graph_nodes.py
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch

from ampguard.decision_graph import captured


class _Mapped:
    """A CUDA view of a pinned host buffer (unified addressing: the pinned pointer is a device pointer)."""

    def __init__(self, pinned: torch.Tensor) -> None:
        typestr = {torch.float32: "<f4", torch.uint8: "|u1"}[pinned.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(pinned.shape), "typestr": typestr,
                                         "data": (pinned.data_ptr(), False), "version": 3, "strides": None}


def chain(x: torch.Tensor, k: int) -> torch.Tensor:
    y = x
    for i in range(k):
        y = y * 1.0001 if i % 2 else y + 0.5
    return y


def main(reps: int = 400) -> None:
    n, k = 60, 70
    x = torch.ones(n, device="cuda")
    pinned = torch.zeros(n, pin_memory=True)
    flag = torch.zeros(1, dtype=torch.uint8, pin_memory=True)
    ev_mid, ev_end = torch.cuda.Event(external=True), torch.cuda.Event(external=True)
    mapped_flag = torch.as_tensor(_Mapped(flag), device="cuda")
    mapped_payload = torch.as_tensor(_Mapped(pinned), device="cuda")
    assert mapped_flag.device.type == "cuda" and mapped_flag.data_ptr() == flag.data_ptr()
    byte = ctypes.c_uint8.from_address(flag.data_ptr())

    def body(variant: str, kk: int = k) -> torch.Tensor:
        y = chain(x, kk // 2)
        if variant == "early":
            flag.copy_((y[:1] > 0).to(torch.uint8), non_blocking=True)
            ev_mid.record()
        if variant == "mapped":
            mapped_flag.copy_((y[:1] > 0).to(torch.uint8) + 1)  # 2: the skip read's "true"; 0: not yet written
        y = chain(y, kk - kk // 2)
        if variant in ("+copy", "+copy+event", "early"):
            pinned.copy_(y, non_blocking=True)
        if variant in ("+event", "+copy+event", "early"):
            ev_end.record()
        if variant == "mapped":
            mapped_payload.copy_(y)
        return y

    variants = ["kernels", "+copy", "+event", "+copy+event", "early", "mapped"]
    graphs = {}
    for v in variants:
        body(v)
        torch.cuda.synchronize()
        graphs[v] = captured(lambda v=v: body(v))[0]
    for kk in (35, 140):
        body("kernels", kk)
        torch.cuda.synchronize()
        graphs[f"kernels k={kk}"] = captured(lambda kk=kk: body("kernels", kk))[0]
    clock = time.perf_counter_ns
    rows = {}
    for _ in range(2):  # the second pass is reported: the first warms
        for name, graph in graphs.items():
            launch, ready = [], []
            for _ in range(reps):
                torch.cuda.synchronize()
                byte.value = 0
                t0 = clock()
                graph.replay()
                t1 = clock()
                if name == "early":
                    ev_mid.synchronize()
                elif name == "mapped":
                    while byte.value == 0:
                        pass
                else:
                    torch.cuda.synchronize()
                t2 = clock()
                launch.append(t1 - t0)
                ready.append(t2 - t0)
            rows[name] = (statistics.quantiles(launch, n=4), statistics.quantiles(ready, n=4))
    torch.cuda.synchronize()
    expect = chain(chain(x, k // 2), k - k // 2)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {reps} reps, a chain of {k} kernels "
          f"on {n} floats")
    print(f"{'variant':<18} {'replay() host us: p25 / median / p75':<40} flag (or graph end) in hand, us")
    for name, (launch, ready) in rows.items():
        print(f"{name:<18} {launch[0] / 1e3:7.1f} / {launch[1] / 1e3:7.1f} / {launch[2] / 1e3:7.1f}"
              f"{'':<16} {ready[0] / 1e3:7.1f} / {ready[1] / 1e3:7.1f} / {ready[2] / 1e3:7.1f}")
    print('payload landed right:',  torch.equal(mapped_payload, expect) and torch.equal(pinned.cuda(), expect))


if __name__ == "__main__":
    main()
