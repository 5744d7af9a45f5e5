"""Cost of the guard's one per-step collective on 2 gloo ranks (CPU).

Runs the same DDP + guarded-AdamW loop three ways on each rank and prints per-step times:

- ``plain``:   no guard (loss.backward(); opt.step()), for reference;
- ``nogather``: the guard with a backend that replicates the local vector instead of
  gathering it (the LocalBackend-equivalent: every other cost of the guard is there);
- ``gather_nohook``: the guard with TorchDistBackend(pre_reduction=False): one all_gather of
  8 floats per rank per step (stats.LOCAL_K);
- ``gather``:   the default TorchDistBackend: that all-gather plus the pre-reduction DDP comm hook.

The figure asked for is ``gather_nohook / nogather`` (the collective alone), and
``gather / nogather`` (everything the distributed backend adds).

    python benchmarks/collective_cost.py [--steps 300] [--width 64]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard
from ampguard.backends.base import ReadyHandle
from ampguard.backends.torch_dist import TorchDistBackend


class NoGatherBackend(TorchDistBackend):
    """TorchDistBackend without its collective and hooks: the vector is replicated locally."""

    def __init__(self) -> None:
        super().__init__(pre_reduction=False)

    def all_gather(self, vec: torch.Tensor) -> ReadyHandle:
        return ReadyHandle(vec.unsqueeze(0).expand(self.world_size, -1).clone())


def _loop(rank: int, mode: str, steps: int, width: int) -> float:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 1)))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt: object = inner
    if mode != "plain":
        if mode == "nogather":
            backend: TorchDistBackend = NoGatherBackend()
        else:
            backend = TorchDistBackend(pre_reduction=(mode == "gather"))
        opt = ampguard.wrap(inner, model=model, precision="fp32", backend=backend)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, width, generator=g), torch.randn(32, 1, generator=g)
    times = []
    for i in range(steps + 20):
        dist.barrier()
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        if mode == "plain":
            loss.backward()
            inner.step()
            inner.zero_grad()
        else:
            opt.backward(loss)  # type: ignore[attr-defined]
            opt.step()  # type: ignore[attr-defined]
            opt.zero_grad()  # type: ignore[attr-defined]
        if i >= 20:
            times.append(time.perf_counter() - t0)
    if mode != "plain":
        opt.close()  # type: ignore[attr-defined]
    return statistics.median(times)


def _worker(rank: int, port: int, steps: int, width: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res: dict[str, list[float]] = {"plain": [], "nogather": [], "gather_nohook": [], "gather": []}
    for _ in range(rounds):  # interleaved, so drift hits every mode alike
        for mode in res:
            res[mode].append(_loop(rank, mode, steps, width))
    if rank == 0:
        med = {m: statistics.median(v) * 1e6 for m, v in res.items()}
        print(f"width={width} steps={steps}x{rounds} (median per-step time, rank 0)")
        for m, v in med.items():
            print(f"  {m:9s} {v:9.1f} us")
        print(f"  gather_nohook/nogather = {med['gather_nohook'] / med['nogather']:.3f}   "
              f"(the all-gather alone adds {med['gather_nohook'] - med['nogather']:.1f} us/step)")
        print(f"  gather/nogather        = {med['gather'] / med['nogather']:.3f}   "
              f"(all-gather + pre-reduction comm hook add {med['gather'] - med['nogather']:.1f} us/step)")
        print(f"  nogather/plain         = {med['nogather'] / med['plain']:.3f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.steps, args.width, args.rounds), nprocs=2, join=True)


if __name__ == "__main__":
    main()
