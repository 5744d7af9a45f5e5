"""The guard's per-step collective against world size: measured on gloo (CPU), modelled to 1024.

The guard all-gathers ``LOCAL_K`` float32 values per rank per step (``ampguard.stats.LOCAL_K``).
This script

1. measures that exact collective (``TorchDistBackend.all_gather`` of a ``LOCAL_K`` vector,
   then ``wait()``) on W gloo ranks spawned on this machine, for W in ``--worlds``, as the
   median over ``--iters`` calls after a warm-up, next to a barrier (the floor of any
   collective on that transport);
2. prints an analytical model of bytes and latency per step up to 1024 ranks, for the
   all-gather the guard uses and for the alternative it could switch to at scale (an
   all-reduce of a W x K "one slot per rank" matrix, which NCCL can run as a tree).

    python benchmarks/scaling.py [--worlds 1,2,4] [--iters 300] [--out results/scaling_cpu.json]

On a 2-core machine, worlds above 2 oversubscribe the cores: their latencies measure the
scheduler as much as the transport, and are labelled so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ampguard.stats import LOCAL_K


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, iters: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from ampguard.backends.torch_dist import TorchDistBackend

    backend = TorchDistBackend()
    vec = torch.full((LOCAL_K,), float(rank))
    gather, barrier = [], []
    for i in range(iters + 30):
        dist.barrier()
        t = time.perf_counter()
        got = backend.all_gather(vec).wait()
        dt = time.perf_counter() - t
        t = time.perf_counter()
        dist.barrier()
        db = time.perf_counter() - t
        if i >= 30:
            gather.append(dt)
            barrier.append(db)
    assert got.shape == (world, LOCAL_K) and torch.equal(got[:, 0], torch.arange(world, dtype=torch.float32))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"gather_us": 1e6 * statistics.median(gather), "barrier_us": 1e6 * statistics.median(barrier),
                       "gather_p90_us": 1e6 * sorted(gather)[int(0.9 * len(gather))]}, f)
    dist.destroy_process_group()


def measure(world: int, iters: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.start_processes(_rank, args=(world, _free_port(), iters, out), nprocs=world, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def model(worlds: list[int], alpha_us: float, beta_gbps: float) -> list[dict[str, Any]]:
    """Per-step cost of the guard's collective at ``world`` ranks.

    all-gather (ring, what NCCL runs): W-1 steps, each moving K floats: latency (W-1)*alpha,
    bytes received per rank (W-1)*K*4.
    all-reduce of a W x K one-slot-per-rank matrix (tree): 2*log2(W) steps of W*K*4 bytes.
    """
    rows = []
    k_bytes = LOCAL_K * 4
    for w in worlds:
        ag_bytes = (w - 1) * k_bytes
        ag_us = (w - 1) * alpha_us + ag_bytes / (beta_gbps * 1e3)
        tree_steps = 2 * math.ceil(math.log2(w)) if w > 1 else 0
        ar_bytes = w * k_bytes
        ar_us = tree_steps * (alpha_us + ar_bytes / (beta_gbps * 1e3))
        rows.append({"world": w, "allgather_bytes_per_rank": ag_bytes, "allgather_us": ag_us,
                     "tree_allreduce_bytes_per_step": ar_bytes * tree_steps, "tree_allreduce_us": ar_us})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--alpha-us", type=float, default=5.0, help="per-hop latency for the model (default 5 us)")
    p.add_argument("--beta-gbps", type=float, default=25.0, help="per-link bandwidth for the model, GB/s")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    measured = []
    for w in (int(x) for x in args.worlds.split(",")):
        r = measure(w, args.iters)
        r.update(world=w, oversubscribed=w > cores)
        measured.append(r)
        print(f"gloo, {w} rank(s){' (oversubscribed)' if w > cores else ''}: all-gather of {LOCAL_K} floats "
              f"{r['gather_us']:.1f} us median (p90 {r['gather_p90_us']:.1f}), barrier {r['barrier_us']:.1f} us")
    rows = model([1, 2, 8, 64, 256, 1024], args.alpha_us, args.beta_gbps)
    print(f"\nmodel (alpha={args.alpha_us} us per hop, beta={args.beta_gbps} GB/s):")
    print(f"{'ranks':>6} {'all-gather B/rank':>18} {'all-gather us':>14} {'tree all-reduce us':>19}")
    for r in rows:
        print(f"{r['world']:>6} {r['allgather_bytes_per_rank']:>18} {r['allgather_us']:>14.1f} "
              f"{r['tree_allreduce_us']:>19.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"measured": measured, "model": rows, "alpha_us": args.alpha_us, "beta_gbps": args.beta_gbps,
                       "torch": torch.__version__, "cores": cores, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime())}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
