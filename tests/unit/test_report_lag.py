"""The report lag of the sync-free path (fused optimizer on CUDA; emulated here on CPU with
``_lagged_reports``): ``step()`` never waits on the previous step's report copy. Step S's report is
decoded at step S+2's ``step()`` (the host may run two steps ahead of the device), or at S+1's
where the next update needs it (a registered scheduler, the ladder); readers decode on demand."""

from __future__ import annotations

import pytest
import torch

import ampguard


def _run(steps: int, *, schedule: bool = False, config: dict | None = None) -> list[list[int]]:
    """The steps whose reports are still pending after each step() call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"), config=config)
    opt._pipeline.host_decision, opt._lagged_reports = False, True  # the fused CUDA path's tensor decision, its lag
    if schedule:
        opt.schedule(torch.optim.lr_scheduler.StepLR(opt, step_size=2))
    pending = []
    for _ in range(steps):
        x = torch.randn(4, 8)
        with opt.autocast():
            loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        pending.append([p.step for p in opt._reporter._pending])
    opt.close()
    return pending


def test_step_waits_on_no_previous_report():
    # after step S's step(): S's own copy and S-1's are in flight; S-2's was decoded at S's step()
    assert _run(5) == [[0], [0, 1], [1, 2], [2, 3], [3, 4]]


@pytest.mark.parametrize("why", ["schedule", "ladder"])
def test_a_scheduler_or_the_ladder_reads_the_previous_step_first(why):
    # the next update's LR (held on a skipped step), the snapshot the ladder names: one step late
    config = {"escalation": ampguard.Escalation(snapshot_every=2)} if why == "ladder" else None
    assert _run(4, schedule=why == "schedule", config=config) == [[0], [1], [2], [3]]
