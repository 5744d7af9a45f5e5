"""Stop 53: the eager fp8 monitor's host time per step on the CPU, on a model that is nothing but casts: 48 torchao
Float8Linear(64, 64) layers (tensorwise, emulated) in a row, batch 8, forward and backward under CPU bf16
autocast, one thread (288 casts a step, as GPT-2 124M's 48 layers). Paired interleaved blocks (order rotated per
round) of ``plain`` (no monitor) and ``monitor`` (``Fp8Monitor(model)`` on unsampled steps: ``begin_step``, the
step, ``collect``); each block's median step. Prints each arm's median and the per-round difference to plain,
p25 / median / p75, in microseconds a step and a cast.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop53/fp8_stack_host.py [--rounds 30]
"""
import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
warnings.filterwarnings("ignore")
import torch  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from ampguard import fp8 as F  # noqa: E402

LAYERS, CASTS = 48, 288


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(LAYERS)])
    model = convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    x = torch.randn(8, 64, requires_grad=True)

    def step(mon, i: int) -> None:  # type: ignore[no-untyped-def]
        if mon is not None:
            mon.begin_step(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        if mon is not None:
            mon.collect()
        for p in model.parameters():
            p.grad = None
        x.grad = None

    arms = {"plain": lambda: None, "monitor": lambda: F.Fp8Monitor(model, numerics_every=10)}
    res: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(args.rounds + 1):
        for name in names if r % 2 else names[::-1]:
            mon = arms[name]()
            for _ in range(2):
                step(mon, 1)
            ts = []
            for i in range(args.steps):
                t = time.perf_counter()
                step(mon, 2 * i + 1)  # odd steps: unsampled (numerics_every=10)
                ts.append(time.perf_counter() - t)
            if mon is not None:
                mon.close()
            if r:  # round 0: warm-up
                res[name].append(statistics.median(ts) * 1e6)
    added = [a - b for a, b in zip(res["monitor"], res["plain"])]
    q = statistics.quantiles(added, n=4)
    plain, monitor = statistics.median(res["plain"]), statistics.median(res["monitor"])
    print(f"plain {plain:8.0f} us a step; monitor {monitor:8.0f} us")
    print(f"added by the monitor: p25 {q[0]:6.0f} / median {q[1]:6.0f} / p75 {q[2]:6.0f} us a step; median "
          f"{q[1] / CASTS:5.2f} us a cast ({CASTS} casts, {LAYERS} layers)")


if __name__ == "__main__":
    main()
