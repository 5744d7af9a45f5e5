"""Non-finite parameters on one rank (issue 27, item 3, several ranks): a NaN written into one element of rank 1's
weight through an integer view (as a bit flip in memory makes it) is found by that rank's parameter check; the flag
rides the next step's gathered vector, so every rank names rank 1 and stops on the same step. Before, rank 1 stopped
alone and rank 0 waited in its next collective until the group's timeout."""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed._common import spawn

FLIP_AFTER = 2


def _body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampguard

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                        config={"param_check_every": 1, "forensics": False})
    stopped_at = None
    for step in range(8):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        try:
            loss = (model(x) - y).square().mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        except ampguard.NonFiniteError:
            stopped_at = step
            break
        if step == FLIP_AFTER and rank == 1:
            with torch.no_grad():  # between two steps: the exponent bits of one element all set, a NaN
                model.module[2].weight.view(torch.int32)[1, 3] |= 0x7FC00000
    anomalies = [(a.step, tuple(a.ranks), tuple(a.params), a.detail) for a in opt.anomalies
                 if a.kind == "nonfinite_params"]
    opt.close()
    return {"stopped_at": stopped_at, "params": anomalies}


def test_non_finite_weights_on_one_rank_stop_every_rank_on_the_same_step_naming_the_rank() -> None:
    ranks = spawn(_body, world_size=2)
    assert ranks[0]["stopped_at"] is not None and ranks[0]["stopped_at"] == ranks[1]["stopped_at"]
    told = [a for a in ranks[0]["params"] if a[1] == (1,)]
    assert told and "parameters non-finite on rank(s) [1]" in told[0][3]
    assert [a[:2] for a in told] == [a[:2] for a in ranks[1]["params"] if not a[2]]  # the same on both ranks
    own = [a for a in ranks[1]["params"] if a[2] and a[2][0].endswith("2.weight")]
    assert own, ranks[1]["params"]  # rank 1's own anomaly names the parameter
    assert told[0][0] > own[0][0]  # acted on from the next step's gathered flag
