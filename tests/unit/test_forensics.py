"""Forensics: the culprit module and phase are named, the cause classified, the ladder climbed."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

import ampguard
from ampguard import faults

from ._models import hook_count, step_once

VOCAB, WIDTH, SEQ, BLOCKS = 32, 16, 8, 6


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(WIDTH)
        self.attn = torch.nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batches(n: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(n)]


def train(opt, model, data, closure: bool = False):
    for tokens in data:
        def run(tokens=tokens):
            opt.zero_grad()
            with opt.autocast():
                logits = model(tokens[:, :-1])
            opt.backward(F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))

        step_once(opt, run, closure=closure)


def located(opt, step):
    found = [a for a in opt.anomalies if a.step == step and a.module is not None]
    assert found, f"no localised anomaly at step {step}: {opt.anomalies}"
    return found[0]


MODULES = ["emb", "blocks.0", "blocks.1.attn", "blocks.2.ln2", "blocks.3.mlp.0", "blocks.4.mlp", "blocks.5", "head"]


@pytest.mark.parametrize("module", MODULES)
def test_forward_fault_names_the_module(module):
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16")
    # step 1: a first NaN arms the hooks; step 3: the fault under test is localised.
    faults.inject(opt, faults.loss("nan", steps=[1]), faults.output(module, "nan", steps=[3]))
    train(opt, model, batches(5))
    a = located(opt, 3)
    assert (a.module, a.phase) == (module, "forward")
    # An injected value: recomputing the module is clean in bf16 and fp32, and no replay ran, so
    # "not reproduced by recompute" (issue 14: not "transient", which only a clean replay shows).
    assert a.cause == "not_reproduced"
    assert "Forensics" in a.detail


@pytest.mark.parametrize("module", ["blocks.0.mlp", "blocks.2", "blocks.3.ln1", "blocks.5.mlp.2", "head"])
def test_backward_fault_names_the_module(module):
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16")
    faults.inject(opt, faults.loss("nan", steps=[1]), faults.backward(module, "inf", steps=[3]))
    train(opt, model, batches(5))
    a = located(opt, 3)
    assert (a.module, a.phase) == (module, "backward")
    assert opt.history[3].skipped and not opt.history[3].nonfinite_loss


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative x, in any precision


def _mlp(middle: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), middle, torch.nn.Linear(8, 1))


def _run_fp16(model, n, arm_step=1, bad=None):
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model,
                        scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    faults.inject(opt, faults.loss("nan", steps=[arm_step]))
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        x = torch.randn(4, 8, generator=g)
        if bad is not None:
            x = bad(step, x)
        with opt.autocast():
            loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    return opt


def test_overflow_and_genuine_nan_are_told_apart():
    # Overflow: activations pushed past 65504 in fp16 (finite in fp32).
    over = _mlp(Scale(1.0))
    opt = _run_fp16(over, 4, bad=lambda s, x: x * (1e5 if s == 3 else 1.0))
    a = located(opt, 3)
    assert a.cause == "overflow" and a.phase == "forward" and a.module == "0"
    # Genuine NaN: log of a negative number (non-finite in fp32 too).
    nan = _mlp(Log())
    opt = _run_fp16(nan, 4, bad=lambda s, x: x if s == 3 else x.abs() + 10.0)
    located_nan = [a for a in opt.anomalies if a.step == 3 and a.module is not None]
    assert located_nan and located_nan[0].module == "1" and located_nan[0].cause == "nan"


def test_replay_closure_localises_on_the_same_step_and_finds_transients():
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16")
    # step 2: a real fault in blocks.4.mlp, present again on replay -> named on step 2 itself.
    # step 4: a one-off fault that fires only on the first run of the batch -> transient.
    inj = faults.inject(opt, faults.output("blocks.4.mlp", "nan", steps=[2]))
    once = {"done": False}

    def flaky(module, args, out):
        if opt.step_count == 4 and not once["done"] and torch.is_grad_enabled():
            once["done"] = True
            return out * float("nan")
        return None

    handle = model.blocks[1].register_forward_hook(flaky)
    train(opt, model, batches(6), closure=True)
    a = located(opt, 2)
    assert (a.module, a.phase) == ("blocks.4.mlp", "forward")
    t = located(opt, 4)
    assert t.cause == "transient" and "replay" in t.detail
    assert [s for s, _, _ in inj.fired] == [2, 2]  # fired on the step and on its replay
    handle.remove()


def test_healthy_run_registers_no_hook_and_hooks_disarm_after_window():
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"forensics_window": 3})
    train(opt, model, batches(4))
    assert hook_count(model) == 0
    faults.inject(opt, faults.loss("nan", steps=[4]))
    train(opt, model, batches(1))
    assert hook_count(model) > 0  # armed after the non-finite step
    train(opt, model, batches(3))
    assert hook_count(model) == 0  # removed after 3 clean steps


def test_escalation_ladder_rolls_back_and_then_stops():
    def run(plan, escalation=None, steps=40, aborts=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        cfg = {"escalation": escalation} if escalation else {}
        opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.05), model=model, precision="bf16",
                            config=cfg, on_abort=(lambda o, d: aborts.append(d)) if aborts is not None else None)
        faults.inject(opt, *plan)
        g = torch.Generator().manual_seed(1)
        w = torch.randn(8, 1, generator=g)
        losses = []
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            with opt.autocast():
                loss = F.mse_loss(model(x).float(), x @ w)
            losses.append(loss.item())
            opt.backward(loss, batch_id=step)
            opt.step()
            opt.zero_grad()
        return opt, model, losses

    _, _, clean = run([])
    # A burst of bad *updates* that are finite (so not skipped) would corrupt; here the burst is
    # non-finite, so rung 1 (skip) holds, and 3 in a window trigger rung 3 (rollback).
    esc = {"rollback_after": 3, "window": 10, "snapshot_every": 5, "max_rollbacks": 1}
    opt, _, losses = run([faults.grad("0.weight", "nan", steps=[21, 22, 23])], esc)
    kinds = [(a.step, a.kind) for a in opt.anomalies]
    assert (23, "rollback") in kinds
    assert opt.quarantine == [21, 22, 23]
    assert opt.state_dict()["ampguard"]["escalation"]["rollbacks"] == 1
    # After the rollback (to the snapshot after step 19) training recovers: within 2 % of the clean
    # run's loss at the same step by the end.
    assert losses[-1] == pytest.approx(clean[-1], rel=0.02)
    # Rung 4: a second burst after max_rollbacks stops training, with a diagnosis and on_abort.
    aborts: list[str] = []
    with pytest.raises(ampguard.NonFiniteError, match="training stopped at step 33") as err:
        run([faults.grad("0.weight", "nan", steps=[21, 22, 23, 31, 32, 33])], esc, aborts=aborts)
    assert aborts and aborts[0] == str(err.value)
    assert "1 rollback(s) did not help" in str(err.value)


def test_rollback_without_snapshot_or_callback_stops_with_reason():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16",
                        config={"escalation": {"rollback_after": 2, "snapshot_every": None}})
    faults.inject(opt, faults.loss("nan", steps=[1, 2]))
    with pytest.raises(ampguard.NonFiniteError, match="no snapshot to roll back to"):
        for _ in range(4):
            opt.backward(model(torch.randn(2, 4)).pow(2).mean())
            opt.step()
            opt.zero_grad()
    assert math.isnan(opt.history[2].loss)


def test_transient_fault_flag_is_clean_on_replay():
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16")
    inj = faults.inject(opt, faults.output("blocks.2.attn", "nan", steps=[1], transient=True))
    train(opt, model, batches(3), closure=True)
    # The hooks were not armed on the step's first pass: the replay shows a transient, but where
    # it was is unknown, so no module is named (issue 14: None, not "" for "the model").
    (t,) = [a for a in opt.anomalies if a.step == 1]
    assert t.cause == "transient" and t.module is None
    assert [s for s, _, _ in inj.fired] == [1]  # not again on the replay


class Fp16Times1000(torch.nn.Module):
    """An fp16 kernel: overflows where |x| > 65.504. Saves nothing for backward."""

    def forward(self, x, tape=None):
        if tape is not None:
            tape.calls.append(x.shape)  # state the call leaves behind, as a KV cache's update
        return x.half() * 1000.0


class ThenZeroes(torch.nn.Module):
    """Its culprit's input is written in place after the call (as a static KV cache is)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0 = torch.nn.Linear(8, 8)
        self.big = Fp16Times1000()

    def forward(self, x, tape=None):
        h = self.l0(x)
        y = self.big(h, tape=tape).float()
        if tape is None:
            h.zero_()
        return y


def _run_fp32(model, tape=None, steps=3):
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model=model, precision="fp32")
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(4, 8, generator=g) * (100.0 if step >= 1 else 0.01)
        opt.backward(model(x, tape=tape).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return next(a for a in opt.anomalies if a.step == steps - 1)


def test_a_saved_input_written_in_place_after_the_call_is_not_recomputed():
    # Before: the recompute ran on the zeroed input, was finite twice, and said "not_reproduced"
    # for a genuine overflow. Now it knows the input changed and says so.
    a = _run_fp32(ThenZeroes())
    assert (a.module, a.phase, a.cause) == ("big", "forward", None), a
    assert "written in place during or after the call" in a.detail and "input max |x| = nan" in a.detail


class Tape:
    """A stateful argument that cannot be copied (it holds a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[torch.Size] = []


def test_a_stateful_argument_that_cannot_be_copied_is_not_recomputed_on_and_left_as_it_was():
    # Before: both recomputes ran on the live object and appended to it (5 calls for 3 forwards).
    tape = Tape()
    a = _run_fp32(ThenZeroes(), tape=tape)
    assert len(tape.calls) == 3  # one per forward: the recompute left it alone
    assert (a.module, a.phase, a.cause) == ("big", "forward", None), a
    assert "tape (Tape) could not be copied" in a.detail
