"""Stop 59: what each part of a payload's landing (ampguard.payload.Landing) costs the host on a device, where the
step graph's early flag with the landing put +53-67 us into guard._measure (host_time.py, MLP foreach, H100).
Times, median of 2000 reps each, the device idle: a Landing made; its event's synchronize() on an external event a
graph recorded (done long ago); host.copy_(pinned) of a 60-float payload; pinned.clone(); pinned.tolist(); and the
whole fill (Landing.synchronize()). Run on the device:
PYTHONPATH=$PWD python benchmarks/results/cpu_stop59/landing_parts.py
"""

from __future__ import annotations

import statistics
import time

import torch

from ampguard.decision_graph import captured
from ampguard.payload import Landing


def main() -> None:
    n = 60
    x = torch.ones(n, device="cuda")
    pinned = torch.empty(n, pin_memory=True)
    event = torch.cuda.Event(external=True)

    def body() -> torch.Tensor:
        y = x * 2.0
        pinned.copy_(y, non_blocking=True)
        event.record()
        return y

    body()
    torch.cuda.synchronize()
    graph, _ = captured(body)
    graph.replay()
    torch.cuda.synchronize()
    host = torch.empty(n)
    clock = time.perf_counter_ns
    parts = {
        "Landing(pinned, event)": lambda: Landing(pinned, event),
        "event.query()": event.query,
        "event.synchronize()": event.synchronize,
        "host.copy_(pinned)": lambda: host.copy_(pinned),
        "pinned.clone()": pinned.clone,
        "pinned.tolist()": pinned.tolist,
        "torch.empty(60)": lambda: torch.empty(n),
    }
    for name, fn in parts.items():
        ts = []
        for _ in range(2000):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        print(f"{name:<26} median {statistics.median(ts) / 1e3:7.2f} us  p90 {sorted(ts)[1800] / 1e3:7.2f} us")
    ts = []
    for _ in range(500):
        graph.replay()
        torch.cuda.synchronize()
        landing = Landing(pinned, event)
        t0 = clock()
        landing.synchronize()
        ts.append(clock() - t0)
    print(f"{'Landing.synchronize()':<26} median {statistics.median(ts) / 1e3:7.2f} us (after a replay, device idle)")


if __name__ == "__main__":
    main()
