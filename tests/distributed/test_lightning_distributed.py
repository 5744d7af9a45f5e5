"""``AmpGuardPrecision`` under a real ``lightning.Trainer`` with ``DDPStrategy`` on 2 gloo ranks (the process group
already up, as a launcher leaves it), fp16 through Lightning's GradScaler path as it builds it on CUDA (the CPU
stand-in of tests/frameworks/test_lightning.py), ``gradient_clip_val``. A corrupt sample on one rank only (an inf
in rank 1's input at step 2): the guarded run skips that step on both ranks, names rank 1, and ends bit for bit
where Lightning's own ``MixedPrecision`` run ends, the same on both ranks. No test ran Lightning on several ranks
before.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ._common import assert_one_rank_fault, reports_and_params, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.frameworks,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

STEPS, BAD_STEP, BAD_RANK, INIT_SCALE = 6, 2, 1, 2.0**10


def _run(rank: int, world_size: int) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from ampguard.integrations.lightning import AmpGuardPrecision

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.head(torch.tanh(self.layer(x))).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    x, y = torch.randn(STEPS * 4, 8, generator=g), torch.randn(STEPS * 4, 1, generator=g)
    if rank == BAD_RANK:
        x[BAD_STEP * 4, 0] = float("inf")
    out: dict[str, Any] = {}
    for guarded in (False, True):
        model = Net()
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        plugin = (AmpGuardPrecision("16-mixed", device="cpu", scaler=scaler) if guarded
                  else MixedPrecision("16-mixed", "cpu", scaler=scaler))
        trainer = L.Trainer(accelerator="cpu", devices=world_size, num_nodes=1, strategy=DDPStrategy(),
                            plugins=[plugin], max_steps=STEPS, gradient_clip_val=0.5, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False)
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
        out["world_size"] = trainer.world_size
        reports, out["guard" if guarded else "plain"] = reports_and_params(plugin.guard if guarded else None, model)
        if guarded:
            out["reports"] = reports
    return out


def test_one_ranks_corrupt_sample_is_skipped_on_every_rank_as_lightning_skips_it() -> None:
    pytest.importorskip("lightning")
    res = spawn(_run, world_size=2)
    assert_one_rank_fault(res, "reports", BAD_STEP, BAD_RANK)
    assert all(torch.equal(out["guard"], out["plain"]) for out in res)  # Lightning's own run, bit for bit
    assert torch.equal(res[0]["guard"], res[1]["guard"])
