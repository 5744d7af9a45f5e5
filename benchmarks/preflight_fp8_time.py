"""What the fp8 preflight's step time holds (docs/fp8.md, "Preflight for fp8"): the median step of
examples/preflight_gpt.py's GPT in bf16, and in torchao float8 (eager) with no fp8 monitoring, with the guard's own
(wrap's default for a model holding Float8Linear), and with the preflight trial's monitor (every cast, every step)
on top. CUDA with fp8 matmuls (compute capability >= 8.9); torchao 0.18.

    python benchmarks/preflight_fp8_time.py [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import preflight_gpt as gpt

import ampguard
from ampguard.fp8 import Fp8Monitor


def median_step_ms(kind: str, steps: int) -> float:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    factories = gpt.make_preflight()
    model = factories["model_fn"]().cuda()
    if kind != "bf16":
        model = convert_to_float8_training(model, config=Float8LinearConfig())
    monitor = Fp8Monitor(model, numerics_every=1) if kind == "fp8, trial monitor too" else None
    opt = ampguard.wrap(factories["optimizer_fn"](model.parameters()), model=model, precision="bf16",
                        fp8=kind not in ("bf16", "fp8, no monitoring"))
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        x, y = factories["batch_fn"](i)
        if monitor is not None:
            monitor.begin_step(i)
        with opt.autocast():
            loss = F.cross_entropy(model(x).float().reshape(-1, gpt.VOCAB), y.reshape(-1))
        opt.backward(loss)
        if monitor is not None:
            monitor.decode(monitor.collect().tolist())
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    opt.close()
    return statistics.median(times[2:]) * 1e3  # the first two pay warm-up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    for kind in ("bf16", "fp8, no monitoring", "fp8, guard monitor", "fp8, trial monitor too"):
        print(f"{kind:>24}: median step {median_step_ms(kind, args.steps):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
