"""The README's headline loop ("Your loop, guarded"), run as written (on the CPU instead of CUDA):
its LR schedule must advance on taken steps only, through a genuine fp16 overflow."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

import ampguard

README = Path(__file__).resolve().parents[2] / "README.md"


def _headline_loop() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Your loop, guarded", 1)[1]
    diff = re.search(r"```diff\n(.*?)```", section, re.DOTALL)
    assert diff, "README's 'Your loop, guarded' has no diff block"
    after = [line[1:] for line in diff.group(1).splitlines() if not line.startswith("-")]  # the guarded side
    return "\n".join(after).replace('"cuda"', '"cpu"')


def test_the_headline_loop_holds_the_lr_on_skipped_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(12)]
    for i in (3, 7):  # batches whose activations overflow fp16 in the first Linear: inf loss, a skipped step
        loader[i] = (loader[i][0] * 1e5, loader[i][1])
    namespace = {"torch": torch, "ampguard": ampguard, "model": model, "loader": loader,
                 "criterion": lambda out, y: F.mse_loss(out.float(), y)}
    exec(compile(_headline_loop(), str(README), "exec"), namespace)  # the README's own code
    opt, sched = namespace["opt"], namespace["sched"]
    taken = len(loader) - opt.skipped_steps
    skipped = [r.step for r in opt.history if r.skipped]
    assert {3, 7} <= set(skipped) and len(skipped) == opt.skipped_steps
    assert sched.last_epoch == taken < len(loader)  # a plain sched.step() in the loop would have counted 12
    expected = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-4), T_max=10_000)
    for _ in range(taken):
        expected.optimizer.step()
        expected.step()
    assert opt.param_groups[0]["lr"] == expected.get_last_lr()[0]
