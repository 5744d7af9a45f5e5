"""Stop 58: can a non-fused step learn its skip flag before the step graph ends? A device experiment, not a benchmark of
the guard.

A non-fused optimizer's guarded step reads the decision's skip flag (its one sync) before it steps. Today that read
waits for the whole step graph: the norms, the flags, the rest of the rule (the reason, the scale rule), the payload's
stacks and cats, the scale writes; ~62 kernels on CUDA for fp16 with a GradScaler
(benchmarks/results/cpu_stop51/decision_ops.py, rerun at stop 58: 72 device ops on the CPU, 12 of them dots that are
one _foreach_norm on CUDA). With the default configuration (no spike detector that skips) the skip needs ~15 of them.
Stop 55's H100 put the read's wait at ~110 us a step on the 8x256 MLP (its inner_step 539 us against the host-decision
arm's 415, which does not wait there).

This script times, on a synthetic graph of N chained 0-d kernels whose flag is ready after K of them:

- ``whole``: replay, then ``out.to("cpu", copy=True)`` (today: the read waits for all N kernels);
- ``early``: the flag copied into a pinned buffer inside the graph after kernel K, then an external event recorded
  there (``torch.cuda.Event(external=True)``: an event record node), then the other N-K kernels; replay, then
  ``event.synchronize()`` and the pinned float read.

The graphs are captured as the guard captures its step graph (``ampguard.decision_graph.captured``). It checks first
that the early read sees each replay's own value (an input changed before each replay), i.e. that the
event's synchronize waits for the latest replay's node. The figure is host time from the replay's launch to the flag
in hand, the device drained before each rep (as benchmarks/host_time.py times a step), median and quartiles, the two
variants interleaved. Run on the device from the repository root: PYTHONPATH=$PWD python
benchmarks/results/cpu_stop58/early_event.py [N K REPS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ampguard.decision_graph import captured


def build(n: int, k: int, early: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                 torch.cuda.Event | None]:
    x_in = torch.zeros((), device="cuda")
    pinned = torch.zeros(1, pin_memory=True) if early else None
    event = torch.cuda.Event(external=True) if early else None
    stream = torch.cuda.Stream()

    def body() -> torch.Tensor:
        x = x_in * 1.0
        flag = x
        for i in range(n):
            x = x * 1.0001 + 1e-7  # two kernels a round on CUDA (mul, add): counted as two below
            if i + 1 == k // 2:
                flag = (x_in > 0).float()  # the "skip": a function of this replay's input
                if early:
                    pinned.copy_(flag.reshape(1), non_blocking=True)  # a D2H memcpy node into pinned memory
                    event.record()  # an event record node (external): the host waits on it
        return torch.stack([flag, x])

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph, out = captured(body)  # the guard's own capture (a side stream, capture_error_mode="thread_local")
    torch.cuda.synchronize()
    return graph, x_in, out, pinned, event


def main() -> None:
    n, k, reps = (int(a) for a in (sys.argv[1:4] if len(sys.argv) >= 4 else ("31", "8", "400")))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {2 * n} chained kernels, the flag after {k}")
    whole = build(n, k, early=False)
    try:
        early = build(n, k, early=True)
    except Exception as exc:  # the point of the experiment: say so plainly
        print(f"early: capture failed: {type(exc).__name__}: {exc}")
        return
    # correctness: each replay's early read is that replay's flag
    graph, x_in, out, pinned, event = early
    wrong = 0
    for i in range(200):
        x_in.fill_(float(i % 2))
        graph.replay()
        event.synchronize()
        wrong += pinned[0].item() != float(i % 2)
    torch.cuda.synchronize()
    print(f"early read: {wrong} of 200 replays read another replay's flag")
    times: dict[str, list[float]] = {"whole": [], "early": []}
    clock = time.perf_counter_ns
    for r in range(reps):
        for name in (("whole", "early") if r % 2 else ("early", "whole")):
            graph, x_in, out, pinned, event = whole if name == "whole" else early
            x_in.fill_(float(r % 2))
            torch.cuda.synchronize()
            t0 = clock()
            graph.replay()
            if name == "whole":
                flag = out.to("cpu", copy=True)[0].item()
            else:
                event.synchronize()
                flag = pinned[0].item()
            t = (clock() - t0) / 1e3
            assert flag == float(r % 2), (name, r, flag)
            times[name].append(t)
    for name, xs in times.items():
        q = statistics.quantiles(xs, n=4)
        print(f"{name:>6}: replay to flag in hand, median {q[1]:.1f} us (p25 {q[0]:.1f}, p75 {q[2]:.1f}), {reps} reps")
    # the graph's device time, for scale: events around a replay
    graph = whole[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(50):
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3)
    print(f"whole graph on the device: median {statistics.median(device):.1f} us ({2 * n + 3} kernels)")


if __name__ == "__main__":
    main()
