"""Stop 53: the eager fp8 monitor's host time per step on the CPU, on a model that is nothing but casts: 48 torchao
Float8Linear(64, 64) layers (tensorwise, emulated) in a row, batch 8, forward and backward under CPU bf16
autocast, one thread (288 casts a step, as GPT-2 124M's 48 layers). Paired interleaved blocks (order rotated per
round) of ``plain`` (no monitor) and ``monitor`` (``Fp8Monitor(model)`` on unsampled steps: ``begin_step``, the
step, ``collect``); each block's median step. ``--parts`` adds ``taps`` (torchao's two functions wrapped by the
taps, no monitor: their pass-through cost) and ``hooks`` (an empty forward pre-hook and forward hook on each layer).
Prints each arm's median step and its per-round difference to plain, p25 / median / p75, in microseconds a step and
a cast.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop53/fp8_stack_host.py [--rounds 30] [--parts]
"""
import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
warnings.filterwarnings("ignore")
import torch  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from ampguard import fp8 as F  # noqa: E402
from ampguard.module_hooks import Hook  # noqa: E402

LAYERS, CASTS = 48, 288


class Part:
    """The ``taps`` or ``hooks`` arm: the monitor's interface, nothing measured; close() takes it off."""

    def __init__(self, model: torch.nn.Module, taps: bool) -> None:
        self.taps, self.handles = taps, []
        if taps:
            F._TAPS.install()
        else:
            for _, m in F.float8_modules(model):
                self.handles.append(m.register_forward_pre_hook(Hook(lambda mod, args: None)))
                self.handles.append(m.register_forward_hook(Hook(lambda mod, args, out: None)))

    def begin_step(self, step: int) -> None:
        pass

    def collect(self) -> None:
        pass

    def close(self) -> None:
        if self.taps:
            F._TAPS.remove()
        for h in self.handles:
            h.remove()


def blocks(arms: dict[str, Callable[[], Any]], step: Callable[[Any, int], None], rounds: int,
           steps: int) -> dict[str, list[float]]:
    """Paired interleaved blocks: per round (the order of ``arms`` rotated each round; round 0 a warm-up, dropped),
    each arm made (``arms[name]()``: a monitor, a :class:`Part` or None), two warm steps, ``steps`` timed ones on
    odd step numbers (unsampled with numerics_every=10; all sampled with 1), closed. Per arm, each block's median
    step in seconds."""
    res: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            mon = arms[name]()
            for _ in range(2):
                step(mon, 1)
            ts = []
            for i in range(steps):
                t = time.perf_counter()
                step(mon, 2 * i + 1)
                ts.append(time.perf_counter() - t)
            if mon is not None:
                mon.close()
            if r:  # round 0: warm-up
                res[name].append(statistics.median(ts))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--parts", action="store_true", help="also the taps alone and empty hooks alone")
    ap.add_argument("--sampled", action="store_true",
                    help="time sampled steps (the underflow and range measured: numerics_every=1) instead")
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

    every = 1 if args.sampled else 10
    arms = {"plain": lambda: None, "monitor": lambda: F.Fp8Monitor(model, numerics_every=every)}
    if args.parts:
        arms.update(taps=lambda: Part(model, taps=True), hooks=lambda: Part(model, taps=False))
    res = {name: [t * 1e6 for t in ts] for name, ts in blocks(arms, step, args.rounds, args.steps).items()}
    names = list(arms)
    print(f"plain {statistics.median(res['plain']):8.0f} us a step ({CASTS} casts, {LAYERS} layers)")
    for name in names[1:]:
        added = [a - b for a, b in zip(res[name], res["plain"])]
        q = statistics.quantiles(added, n=4)
        print(f"added by the {name + ':':8s} p25 {q[0]:6.0f} / median {q[1]:6.0f} / p75 {q[2]:6.0f} us a step; "
              f"median {q[1] / CASTS:5.2f} us a cast")


if __name__ == "__main__":
    main()
