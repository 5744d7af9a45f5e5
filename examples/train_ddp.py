"""DDP training under ampguard, with a NaN injected on one rank only.

    torchrun --nproc-per-node 2 examples/train_ddp.py            # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20 --fault-step 5

Rank 1's loss is NaN at ``--fault-step``: every rank skips that step (the decision is taken
from values gathered from every rank), the report names rank 1, and the ranks end with
identical parameters. Exit code 0 when that holds.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard
from ampguard import faults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=10)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = ampguard.wrap(opt, model=model, precision="fp16" if cuda else "bf16",  # + ampguard
                        config={"consistency_every": 10})
    injection = faults.inject(opt, model, faults.loss("nan", steps=[args.fault_step], ranks=[1]))

    g = torch.Generator(device="cpu").manual_seed(rank)  # each rank its own data
    for _step in range(args.steps):
        x = torch.randn(64, 32, generator=g).to(device)
        y = x[:, :1].sin()
        with opt.autocast():                                   # + ampguard
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)                                     # + ampguard (was loss.backward())
        opt.step()
        opt.zero_grad(set_to_none=True)

    injection.remove()
    skipped = [r for r in opt.history if r.skipped]
    if rank == 0:
        for r in skipped:
            print(f"step {r.step} skipped on every rank: {r.reason}, from rank(s) {list(r.nonfinite_ranks)}")
        print(f"final loss {opt.last_report.loss:.4f}, loss scale {opt.get_scale():g}")
    # every rank holds the same parameters
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], t) for t in gathered)
    ok = same and [r.step for r in skipped] == [args.fault_step] and skipped[0].nonfinite_ranks == (1,)
    if rank == 0:
        print("ranks agree" if ok else "RANKS DISAGREE")
    opt.close()
    # Leave together, and free DDP (its reducer holds the process group) before destroying the
    # group: otherwise gloo can abort at exit ("terminate called without an active exception").
    dist.barrier()
    del opt, model, injection
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
