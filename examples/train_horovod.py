"""Horovod training under ampguard, with an inf injected into one rank's gradient.

    horovodrun -np 2 -H localhost:2 --gloo python examples/train_horovod.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/train_horovod.py --steps 20 --fault-step 5

The guard does Horovod's order for you: ``synchronize()``, unscale and check, step inside
``skip_synchronize()``, scale update. Rank 1's gradient of ``0.weight`` holds an inf at
``--fault-step`` before the all-reduce: every rank skips that step and the report names
rank 1. Exit code 0 when that holds and the ranks end with identical parameters.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from torch import nn

import ampguard
from ampguard import faults
from ampguard.backends.horovod import broadcast_guard_state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=10)
    args = ap.parse_args()

    hvd.init()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt = ampguard.wrap(opt, model=model, precision="fp16" if cuda else "bf16")   # + ampguard
    broadcast_guard_state(opt, root_rank=0)  # a resumed/elastic rank starts with rank 0's scale
    injection = faults.inject(opt, model, faults.grad("0.weight", "inf", steps=[args.fault_step], ranks=[1]))

    g = torch.Generator(device="cpu").manual_seed(hvd.rank())
    for _step in range(args.steps):
        x = torch.randn(64, 32, generator=g).to(device)
        y = x[:, :1].sin()
        with opt.autocast():                                   # + ampguard
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)                                     # + ampguard (was loss.backward())
        opt.step()                                             # synchronize + check + step
        opt.zero_grad(set_to_none=True)

    injection.remove()
    skipped = [r for r in opt.history if r.skipped]
    if hvd.rank() == 0:
        for r in skipped:
            print(f"step {r.step} skipped on every rank: {r.reason}, from rank(s) {list(r.nonfinite_ranks)}")
        print(f"final loss {opt.last_report.loss:.4f}, loss scale {opt.get_scale():g}")
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="check.params")
    same = all(torch.equal(gathered[0], row) for row in gathered)
    ok = same and [r.step for r in skipped] == [args.fault_step] and skipped[0].nonfinite_ranks == (1,)
    if hvd.rank() == 0:
        print("ranks agree" if ok else "RANKS DISAGREE")
    opt.close()
    hvd.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
