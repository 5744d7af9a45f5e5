"""Stop 53: the host time the eager fp8 monitor adds to a step, on the CPU (where torchao float8 trains emulated).

On the H100, eager fp8 at batch 8 is host-bound (89 ms of wall against 49 ms of kernels a step) and the unsampled
monitor added 3.0 ms a step (`benchmarks/results/gpu_stop53/call4/fp8_eager_b8.txt`) for 16 launches: host time. This
measures that host time where it can be measured without a GPU: a 12-layer, width-64 GPT-2-style model (48
Float8Linear, 288 casts a step), forward and backward under CPU bf16 autocast, one thread, in paired interleaved
blocks (order rotated per round) of these arms, each block's median step:

- ``plain``: no monitor;
- ``taps``: torchao's two functions wrapped by the monitor's taps, no monitor (the pass-through cost);
- ``hooks``: an empty forward pre-hook and forward hook on each Float8Linear (the cost of a hook being there);
- ``monitor``: ``Fp8Monitor(model)`` on unsampled steps (``begin_step``, the step, ``collect``).

Prints, per arm, the median of its block medians and the median of its per-round difference to ``plain``'s (ms).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop53/fp8_host.py [--rounds 8]
"""
import argparse
import statistics
import sys
import warnings
from pathlib import Path

root = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(root), str(root / "benchmarks"), str(Path(__file__).resolve().parent)]
warnings.filterwarnings("ignore")
import fp8_cost  # noqa: E402
import torch  # noqa: E402
from fp8_stack_host import Part, blocks  # noqa: E402  (the arms and their timed blocks: the same for both probes)

from ampguard import fp8 as F  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = fp8_cost._model(argparse.Namespace(width=64, layers=12, seq=8, device="cpu"))
    x = torch.randint(0, 8192, (1, 8))

    def step(mon, i: int) -> None:  # type: ignore[no-untyped-def]
        if mon is not None:
            mon.begin_step(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if mon is not None:
            mon.collect()
        for p in model.parameters():
            p.grad = None

    arms = {"plain": lambda: None, "taps": lambda: Part(model, taps=True), "hooks": lambda: Part(model, taps=False),
            "monitor": lambda: F.Fp8Monitor(model, numerics_every=10)}
    res = {name: [t * 1e3 for t in ts] for name, ts in blocks(arms, step, args.rounds, args.steps).items()}
    names = list(arms)
    for name in names:
        added = [a - b for a, b in zip(res[name], res["plain"])]
        print(f"{name:8s} median step {statistics.median(res[name]):7.3f} ms   added to plain: median "
              f"{statistics.median(added):6.3f} ms (p25 {statistics.quantiles(added, n=4)[0]:6.3f}, p75 "
              f"{statistics.quantiles(added, n=4)[2]:6.3f})")


if __name__ == "__main__":
    main()
