"""When forensics arms under fp16 with a GradScaler: not on an overflow of the backward with a finite loss that the
scale has not yet been backed off for (GradScaler's growth overshooting, by design, every ``growth_interval``
steps: arming on it cost ``forensics_window`` steps of hooks on every module and a host sync each), but on a
non-finite step right after one that backed the scale off (a fault that backing off did not cure), and at once on
a non-finite loss. Real models and real overflows:
a tiny GPT-2 from its ``transformers`` config whose loss scale grows until its fp16 backward overflows, and a
hand-written RMS without an epsilon whose backward goes NaN on a zero row.
"""

from __future__ import annotations

import pytest
import torch

import ampguard

from ._models import hook_count

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_overflows_of_a_growing_loss_scale_do_not_arm_forensics(hysteresis: int) -> None:
    """GPT-2 in fp16, GradScaler from its default 2**16, doubling every 2 clean steps: its backward overflows for
    real, the scale backs off, grows again, overflows again. An overflow the scale has not yet been backed off for
    arms nothing: a lone one (hysteresis 1, GradScaler's rule), or the first of a pair (hysteresis 2: the first
    overflow after a growth keeps the scale, so the next step overflows too). The first overflow that follows a
    back-off arms the hooks (from then on: the window is 50 steps)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                                                 n_layer=2, n_head=2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, scaler=scaler,
                        config={"hysteresis": hysteresis})
    g = torch.Generator().manual_seed(1)
    armed = []
    for _ in range(16):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        armed.append(hook_count(model) > 0)  # the CPU's reports are read in their own step(): armed for the next
    history = opt.history
    assert not any(r.nonfinite_loss for r in history)  # overflows of the backward, the loss finite
    bad = [r.step for r in history if r.nonfinite]
    uncured = [k for k in bad if k - 1 in bad and history[k - 1].scale_backoff]
    routine = [k for k in bad if not uncured or k < uncured[0]]
    assert len(routine) >= 2, bad  # genuine overflows, none armed
    if hysteresis == 2:
        assert any(k - 1 in routine for k in routine), bad  # a pair in a row, the first not backed off
    assert armed == [any(k <= i for k in uncured) for i in range(16)], (bad, armed)
    assert not [a for a in opt.anomalies if a.module is not None and a.step < (uncured or [16])[0]]


class _RmsGain(torch.nn.Module):
    """``x`` times its root mean square, written by hand without an epsilon: finite forward, but on an all-zero row
    the square root's gradient is infinite and times the zero row's 2x a NaN (0 * inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x * x).mean(-1, keepdim=True).sqrt()


def test_a_lasting_backward_fault_with_a_finite_loss_is_still_named() -> None:
    """A zero row in every batch (padding): the backward goes NaN at the hand-written RMS gain on every step,
    whatever the scale, the loss finite. The first step looks like a routine overflow (not armed), the second
    arms, the third is named: the gain, in the backward, a NaN (before this rule: armed after the first, named on
    the second)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), _RmsGain(), torch.nn.Linear(8, 1))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model,
                        scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    g = torch.Generator().manual_seed(0)
    armed = []
    for _ in range(4):
        x = torch.randn(4, 8, generator=g)
        x[0] = 0.0
        with opt.autocast():
            loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        armed.append(hook_count(model) > 0)
    assert all(r.nonfinite and not r.nonfinite_loss for r in opt.history)
    assert armed == [False, True, True, True]
    named = [a for a in opt.anomalies if a.module is not None]
    assert named and (named[0].step, named[0].module, named[0].phase, named[0].cause) == (2, "1", "backward", "nan")
