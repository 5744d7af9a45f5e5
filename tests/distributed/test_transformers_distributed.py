"""``GuardedTrainer`` on 2 gloo ranks (the process group up as ``torchrun`` leaves it: the Trainer runs its DDP over
it, each rank its shard of the data), fp16 through accelerate's GradScaler path as on CUDA (the CPU stand-in of
tests/frameworks/test_transformers.py), ``max_grad_norm=1``, gradient accumulation 2, a tiny GPT-2:

- healthy, the guarded run ends bit for bit where the plain ``Trainer`` ends, on both ranks;
- a NaN in one block's output on rank 1 only, at step 2 (``ampguard.faults``): that step is skipped on both
  ranks, named as rank 1's, and both ranks end with the same weights.

No test ran the Trainer on several ranks before.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

from ._common import assert_one_rank_fault, reports_and_params, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.frameworks,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

BAD_STEP, BAD_RANK = 2, 1


def _run(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what torchrun sets
    from transformers import Trainer, TrainerCallback

    from ampguard import faults
    from ampguard.integrations.transformers import GuardedTrainer

    from ..frameworks.test_transformers import LAYER, _args, _fp16_as_on_cuda, _model, _Tokens

    class Inject(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.trainer: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            faults.inject(self.trainer.guard, self.trainer.model,
                          faults.output(LAYER, "nan", steps=[BAD_STEP], ranks=[BAD_RANK]))

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("plain", "guarded", "fault"):
            inject = Inject() if name == "fault" else None
            cls = Trainer if name == "plain" else GuardedTrainer
            trainer = cls(model=_model(0), args=_args(tmp, "fp16", ddp_backend="gloo"), train_dataset=_Tokens(),
                          callbacks=[inject] if inject else None)
            if inject is not None:
                inject.trainer = trainer
            _fp16_as_on_cuda(trainer)
            trainer.train()
            out["world_size"] = trainer.args.world_size
            model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
            out[f"{name}_reports"], out[name] = reports_and_params(trainer.guard if name != "plain" else None, model)
    return out


def test_the_trainer_on_two_ranks() -> None:
    pytest.importorskip("transformers")
    res = spawn(_run, world_size=2)
    assert_one_rank_fault(res, "fault_reports", BAD_STEP, BAD_RANK)
    for r, out in enumerate(res):
        assert not any(skipped for _, skipped, _ in out["guarded_reports"]), (r, out["guarded_reports"])
        assert torch.equal(out["guarded"], out["plain"]), r
    assert torch.equal(res[0]["fault"], res[1]["fault"]) and torch.equal(res[0]["guarded"], res[1]["guarded"])

