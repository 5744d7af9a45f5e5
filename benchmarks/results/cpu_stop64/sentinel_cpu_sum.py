"""Stop 64: what the sentinel's sum of one bf16 block output costs on the CPU, the way it summed before
(``torch.sum(t, dim=all, dtype=float32, out=slot)``: the CPU copies ``t`` to float32 first) and the way it sums now
(``slot.copy_(t.sum())``: bf16's sum accumulates in float32 without the copy). CUDA's reduction reads bf16 as it is.

    OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop64/sentinel_cpu_sum.py \
        > benchmarks/results/cpu_stop64/sentinel_cpu_sum.out
"""

from __future__ import annotations

import statistics
import time

import torch


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of 7 rounds of 50 calls")
    for shape in [(8, 128, 256), (8, 1024, 768)]:
        t = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).bfloat16()
        slots = torch.zeros(3)
        slot = slots[1]

        def before(t: torch.Tensor = t, slot: torch.Tensor = slot) -> None:
            torch.sum(t, dim=tuple(range(t.dim())), dtype=torch.float32, out=slot)

        def now(t: torch.Tensor = t, slot: torch.Tensor = slot) -> None:
            slot.copy_(t.sum())

        rounds: dict[str, list[float]] = {"before": [], "now": []}
        for _ in range(7):
            for name, fn in (("before", before), ("now", now)):
                for _ in range(5):
                    fn()
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                rounds[name].append((time.perf_counter() - t0) / 50 * 1e6)
        b, n = statistics.median(rounds["before"]), statistics.median(rounds["now"])
        print(f"{'x'.join(map(str, shape))} bf16: before {b:.1f} us, now {n:.1f} us ({b / n:.1f}x); sums "
              f"{torch.sum(t, dtype=torch.float32).item():.4f} (float32) and {t.sum().item():.4f} (bf16)")


if __name__ == "__main__":
    main()
