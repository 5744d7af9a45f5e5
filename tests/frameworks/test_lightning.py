"""AmpGuardPrecision under a real ``lightning.Trainer`` (CPU, nothing mocked).

Each guarded run is compared with Lightning's own unguarded run of the same model and data:
``MixedPrecision`` (fp16, GradScaler) or ``Trainer(precision="bf16-mixed")``. The faults come from
:mod:`ampguard.faults`: on the guarded run installed on ``plugin.guard`` (steps are the guard's),
on the reference through the same :class:`~ampguard.faults.Injection` counting Lightning's
``global_step`` (equal to the guard's step count when every batch reaches the optimizer).

fp16 on CPU: Lightning turns ``Trainer(precision="16-mixed")`` into bf16 on CPU, so the fp16 runs
build the plugins the way Lightning's accelerator connector builds ``MixedPrecision`` on CUDA, with
the CPU device in its place: ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))``
for the reference and ``AmpGuardPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))``
for the guard. Autocast is then float16 on CPU and Lightning's GradScaler code path runs
(``scaler.scale`` in ``pre_backward``, ``unscale_`` before clipping, ``scaler.step``, ``update``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

import ampguard
from ampguard import faults
from ampguard.errors import GuardStateError
from ampguard.integrations._versions import IntegrationVersionError
from ampguard.integrations.lightning import AmpGuardPrecision, HeldScheduler

from ._steps import StepHooks

pytestmark = [
    pytest.mark.frameworks,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's num_workers / None-step / logging hints
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*"),  # Lightning's, with torch 2.13
]

INIT_SCALE = 2.0**10
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterable[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic CPU kernels, and a fair share of a shared machine
    yield
    torch.set_num_threads(threads)


class Net(L.LightningModule):
    """Linear-tanh-linear. ``sched``: a LambdaLR (x0.5 per step) with ``interval="step"``.
    ``skip_at``: global steps whose ``training_step`` returns None. ``manual``: manual optimization."""

    def __init__(self, *, sched: bool = False, skip_at: Iterable[int] = (), manual: bool = False,
                 optimizers: int = 1, guarded: bool = False, lbfgs: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.sched, self.skip_at, self.n_opt, self.guarded, self.lbfgs = sched, set(skip_at), optimizers, guarded, lbfgs
        self.automatic_optimization = not manual
        self.calls = 0  # training_step calls
        self.user_guard: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(x)))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls += 1
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss.detach()
        return None if self.global_step in self.skip_at else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y))

    def configure_optimizers(self) -> Any:
        if self.lbfgs:
            return torch.optim.LBFGS(self.parameters())
        opts = [torch.optim.AdamW(self.parameters(), lr=1e-2) for _ in range(self.n_opt)]
        if self.guarded:
            self.user_guard = ampguard.wrap(opts[0], precision="bf16")
            return self.user_guard
        if self.sched:
            sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda n: 0.5**n)
            return {"optimizer": opts[0], "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opts if self.n_opt > 1 else opts[0]


def loader(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * batches, 8, generator=g), torch.randn(4 * batches, 1, generator=g))
    return DataLoader(data, batch_size=4)


class Recorder(L.Callback):
    """Per batch: the LR the step will use, and the parameters after it. Installs ``fault`` on
    ``plugin.guard`` (guarded runs) or on Lightning's global step (reference runs)."""

    def __init__(self, fault: faults.Fault | None = None) -> None:
        self.fault = fault
        self.injection: faults.Injection | None = None
        self.lrs: list[float] = []
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.fault is None:
            return
        guard = getattr(trainer.precision_plugin, "guard", None)
        if guard is not None:
            self.injection = faults.inject(guard, pl_module, self.fault)
        else:
            self.steps = StepHooks(lambda: trainer.global_step)
            self.injection = faults.Injection(self.steps, pl_module, [self.fault])

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        if getattr(self, "steps", None) is not None:
            self.steps.before()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.params.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
        if getattr(self, "steps", None) is not None:
            self.steps.after()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.injection is not None:
            self.injection.remove()


def fit(module: Net, *, plugin: Any = None, precision: str | None = None, batches: int = 8, epochs: int = 1,
        fault: faults.Fault | None = None, callbacks: Iterable[L.Callback] = (), ckpt_path: str | None = None,
        **trainer_kw: Any) -> tuple[L.Trainer, Recorder]:
    rec = Recorder(fault)
    kw: dict[str, Any] = {"enable_checkpointing": False, **trainer_kw}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=[plugin] if plugin else None,
                        precision=precision, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[rec, *callbacks], **kw)
    trainer.fit(module, train_dataloaders=loader(batches), ckpt_path=ckpt_path)
    return trainer, rec


def fp16_plugins() -> tuple[AmpGuardPrecision, MixedPrecision]:
    """The guarded and the reference fp16 plugin, built as Lightning builds MixedPrecision on CUDA."""
    return (AmpGuardPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)))


def inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, ampguard.GuardedOptimizer) else optimizer


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def skipped(plugin: AmpGuardPrecision) -> list[int]:
    assert plugin.guard is not None
    return [r.step for r in plugin.guard.history if r.skipped]


def assert_finite(module: torch.nn.Module) -> None:
    assert all(torch.isfinite(p).all() for p in module.parameters())


# ---------------------------------------------------------------------- fp16 and bf16 against Lightning's own runs
def test_fp16_accumulation_and_norm_clipping_match_lightning_gradscaler_path() -> None:
    """fp16 through Lightning's GradScaler code (see the module docstring for the CPU setup),
    ``accumulate_grad_batches=2``, ``gradient_clip_val`` by norm, a NaN at optimizer step 1: the
    guarded run skips step 1 where GradScaler skips it, and every parameter, the optimizer state and
    the loss scale are bitwise Lightning's own run's, batch by batch."""
    guarded_plugin, reference_plugin = fp16_plugins()
    fault = faults.output("layer", "nan", steps=[1])
    kw: dict[str, Any] = {"batches": 12, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "fault": fault}
    g_mod, r_mod = Net(), Net()
    g_tr, g = fit(g_mod, plugin=guarded_plugin, **kw)
    r_tr, r = fit(r_mod, plugin=reference_plugin, **kw)

    assert g.injection is not None and [s for s, _, _ in g.injection.fired] == [1, 1]  # both micro-batches
    assert skipped(guarded_plugin) == [1]
    assert_same(g.params, r.params, "params")
    assert_same(inner(g_tr.optimizers[0]).state_dict(), r_tr.optimizers[0].state_dict(), "optimizer")
    assert guarded_plugin.scaler is not None and reference_plugin.scaler is not None
    assert guarded_plugin.scaler.get_scale() == reference_plugin.scaler.get_scale() == INIT_SCALE / 2
    assert all(torch.equal(g.params[1][n], g.params[3][n]) for n in g.params[1])  # step 1 (batches 2, 3) skipped
    assert_finite(g_mod)
    guard = guarded_plugin.guard
    assert guard is not None and g_tr.global_step == guard.step_count == 6
    report = guard.history[1]
    assert report.skipped and report.nonfinite_grads > 0 and report.loss_scale == INIT_SCALE
    # the reports hold the norm before Lightning clipped to 0.5
    assert max(r.grad_norm for r in guard.history if not r.skipped) > 0.5


def test_bf16_accumulation_and_value_clipping_match_lightning() -> None:
    """bf16-mixed, ``accumulate_grad_batches=2``, clipping by value: bitwise
    ``Trainer(precision="bf16-mixed")``; the guard reports every step, none skipped, with the
    step's loss (the micro-batch losses Lightning divided by 2, summed)."""
    plugin = AmpGuardPrecision("bf16-mixed")
    kw: dict[str, Any] = {"batches": 8, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05,
                          "gradient_clip_algorithm": "value"}
    g_tr, g = fit(Net(), plugin=plugin, **kw)
    r_tr, r = fit(Net(), precision="bf16-mixed", **kw)

    assert_same(g.params, r.params, "params")
    assert_same(inner(g_tr.optimizers[0]).state_dict(), r_tr.optimizers[0].state_dict(), "optimizer")
    assert plugin.guard is not None and plugin.guard.step_count == 4 and skipped(plugin) == []
    assert plugin.scaler is None and plugin.guard.scaler is None
    assert all(math.isfinite(rep.loss) and rep.loss > 0 for rep in plugin.guard.history)


def test_bf16_nan_step_is_skipped_like_a_batch_lightning_skips() -> None:
    """bf16 with a NaN at step 2 and norm clipping: the guard skips step 2; the run is bitwise
    Lightning's own bf16 run whose ``training_step`` returns None at step 2 (no update)."""
    plugin = AmpGuardPrecision("bf16-mixed")
    g_tr, g = fit(Net(), plugin=plugin, fault=faults.output("layer", "nan", steps=[2]), gradient_clip_val=0.5)
    r_tr, r = fit(Net(skip_at=[2]), precision="bf16-mixed", gradient_clip_val=0.5)

    assert skipped(plugin) == [2]
    assert_same(g.params, r.params, "params")
    assert_same(inner(g_tr.optimizers[0]).state_dict(), r_tr.optimizers[0].state_dict(), "optimizer")
    assert_finite(g_tr.lightning_module)
    guard = plugin.guard
    assert guard is not None and guard.last_report is not None and guard.last_report.step == 7
    assert [a.step for a in guard.anomalies] == [2]
    assert max(r.grad_norm for r in guard.history if not r.skipped) > 0.5  # measured before clipping


# ---------------------------------------------------------------------- schedulers
def test_step_scheduler_is_held_on_skipped_steps() -> None:
    """A LambdaLR (x0.5 per step, ``interval="step"``) with NaNs at steps 1 and 3: Lightning calls
    the scheduler after every step; the plugin's :class:`HeldScheduler` holds it after the two
    skipped ones, so step s runs at 1e-2 * 0.5**(steps taken before s)."""
    plugin = AmpGuardPrecision("bf16-mixed", log=True)
    module = Net(sched=True)
    trainer, rec = fit(module, plugin=plugin, batches=6, fault=faults.output("layer", "nan", steps=[1, 3]))

    assert skipped(plugin) == [1, 3]
    taken_before = [0, 1, 1, 2, 2, 3]
    assert rec.lrs == [1e-2 * 0.5**t for t in taken_before]
    held = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(held, HeldScheduler) and held.held == 2
    assert isinstance(held.scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert module.lr_schedulers() is held and held.get_last_lr() == [1e-2 * 0.5**4]
    assert held.state_dict() == held.scheduler.state_dict()
    logged = trainer.callback_metrics  # log=True: the guard's numbers through self.log
    assert (logged["ampguard/skipped_steps"], logged["ampguard/skipped"], logged["ampguard/loss_scale"]) == (2, 0, 1)


def test_step_scheduler_is_held_without_reading_the_decision_on_the_sync_free_path(monkeypatch) -> None:
    """The fused CUDA path, emulated on CPU (the tensor decision, reports decoded at the next
    step): the plugin hands the scheduler to the guard (``opt.schedule``), so Lightning's call of
    ``scheduler.step()`` reads no decision (on CUDA: no sync), and every update still runs at
    1e-2 * 0.5**(steps taken before it)."""
    class Fused(Net):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5**n)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    seen: list[float] = []

    class Lagged(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            guard = trainer.precision_plugin.guard
            guard._pipeline.host_decision = False  # CUDA's tensor decision
            guard._lagged_reports = True  # and its lag: a report decoded at the next step()
            # the LR the inner (fused) optimizer's update reads, skipped steps included
            guard.optimizer.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))

    reads = {"n": 0}
    original = ampguard.GuardedOptimizer.step_was_skipped

    def counted(self: ampguard.GuardedOptimizer) -> bool:
        reads["n"] += 1
        return original.fget(self)  # type: ignore[attr-defined,no-any-return]

    monkeypatch.setattr(ampguard.GuardedOptimizer, "step_was_skipped", property(counted))
    plugin = AmpGuardPrecision("bf16-mixed")
    trainer, _ = fit(Fused(), plugin=plugin, batches=6, fault=faults.output("layer", "nan", steps=[1, 3]),
                     callbacks=[Lagged()])
    assert reads["n"] == 0  # nobody waited for a decision
    assert skipped(plugin) == [1, 3]
    assert seen == [1e-2 * 0.5**t for t in (0, 1, 1, 2, 2, 3)]
    held = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(held, HeldScheduler) and held.sync_free and held.held == 2


def test_manual_optimization_keeps_the_reading_scheduler() -> None:
    """In manual optimization you call ``scheduler.step()`` when you choose: the wrapper stays the
    one that reads the skip (the guard does not step it for you)."""
    class Manual(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.lr_schedulers().step()
            return loss

    plugin = AmpGuardPrecision("bf16-mixed")
    trainer, _ = fit(Manual(sched=True, manual=True), plugin=plugin, batches=6,
                     fault=faults.output("layer", "nan", steps=[1, 3]))
    held = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(held, HeldScheduler) and not held.sync_free and held.held == 2
    assert held.get_last_lr() == [1e-2 * 0.5**4]


def test_fused_optimizer_can_be_clipped() -> None:
    """Lightning's own fp16 plugin refuses to clip a fused optimizer (it would unscale inside its
    step); under the guard, which unscales before clipping, it trains and skips the NaN step."""
    class Fused(Net):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    plugin, reference = fp16_plugins()
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(Fused(), plugin=reference, batches=4, gradient_clip_val=0.5)
    trainer, _ = fit(Fused(), plugin=plugin, batches=4, gradient_clip_val=0.5,
                     fault=faults.output("layer", "nan", steps=[1]))
    assert skipped(plugin) == [1]
    assert_finite(trainer.lightning_module)
    assert max(r.grad_norm for r in plugin.guard.history if not r.skipped) > 0.5  # type: ignore[union-attr]


class _SeesGrads(Net):
    """Notes, at each ``training_step``, whether the previous step's gradients are still there."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.held: list[bool] = []
        self.before: list[bool] = []  # _OwnBeforeZeroGrad's

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.held.append(any(p.grad is not None for p in self.parameters()))
        return super().training_step(batch, batch_idx)


class _BeforeZeroGrad(L.Callback):
    """An ``on_before_zero_grad`` hook, which Lightning calls after ``training_step`` with the previous step's
    gradients still there."""

    def __init__(self) -> None:
        self.held: list[bool] = []

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.held.append(any(p.grad is not None for p in pl_module.parameters()))


class _OwnBeforeZeroGrad(_SeesGrads):
    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.before.append(any(p.grad is not None for p in self.parameters()))


class _OwnZeroGrad(_SeesGrads):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)  # keeps the buffers: the plugin must not free them first


def test_previous_gradients_are_freed_before_training_step_where_lightning_frees_them_after() -> None:
    """Lightning's closure runs ``training_step``, then ``zero_grad``, then the backward, so the previous step's
    gradients live through the forward and each backward puts the new ones elsewhere (on CUDA: new addresses
    every step, so the guard's measurement graph never replays; stop 54). The plugin frees them just before the
    closure instead: ``training_step`` finds none from the second step on, where Lightning's own run finds them,
    and the run is Lightning's own, bit for bit (fp16, a NaN step skipped, clipping by norm)."""
    guarded_plugin, reference_plugin = fp16_plugins()
    kw: dict[str, Any] = {"batches": 6, "gradient_clip_val": 0.5, "fault": faults.output("layer", "nan", steps=[2])}
    g_mod, r_mod = _SeesGrads(), _SeesGrads()
    _, g = fit(g_mod, plugin=guarded_plugin, **kw)
    _, r = fit(r_mod, plugin=reference_plugin, **kw)
    assert r_mod.held == [False] + [True] * 5  # Lightning's order
    assert g_mod.held == [False] * 6
    assert skipped(guarded_plugin) == [2]
    assert_same(g.params, r.params, "params")


@pytest.mark.parametrize("case", ["accumulating", "on_before_zero_grad", "module on_before_zero_grad",
                                  "optimizer_zero_grad", "opted out"])
def test_previous_gradients_stay_where_something_could_tell(case: str) -> None:
    """Lightning's order is kept where freeing first would show: an accumulation window (the closure of the
    stepping micro-batch zeroes nothing), an ``on_before_zero_grad`` hook (it reads the gradients after
    ``training_step``), the module's own ``optimizer_zero_grad``, and ``free_grads_first=False``."""
    kind = {"optimizer_zero_grad": _OwnZeroGrad, "module on_before_zero_grad": _OwnBeforeZeroGrad}.get(case, _SeesGrads)
    module, reference = kind(), kind()
    hook = _BeforeZeroGrad()
    plugin = AmpGuardPrecision("bf16-mixed", free_grads_first=case != "opted out")
    kw: dict[str, Any] = {"batches": 6, "accumulate_grad_batches": 2 if case == "accumulating" else 1}
    _, g = fit(module, plugin=plugin, callbacks=[hook] if case == "on_before_zero_grad" else [], **kw)
    _, r = fit(reference, precision="bf16-mixed", **kw)
    assert module.held == reference.held and any(module.held), (module.held, reference.held)
    if case == "on_before_zero_grad":
        assert hook.held == [False] + [True] * 5
    if case == "module on_before_zero_grad":
        assert module.before == reference.before == [False] + [True] * 5
    assert_same(g.params, r.params, "params")


class _ReadsGrads(L.Callback):
    """A callback that looks at the gradients before the step, as Lightning documents them (unscaled)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in pl_module.parameters()]))))


def test_norm_clipping_of_a_fused_optimizer_is_folded_into_its_step(monkeypatch) -> None:
    """Issue 26: ``gradient_clip_val`` by norm with a fused optimizer and fp16 goes through the guard's
    ``clip_grad_norm_``, folded into the fused step (no unscale pass, no torch clip), where no
    ``on_before_optimizer_step`` hook reads the gradients; with such a hook the gradients are unscaled for it
    first and torch clips them. Both train to the same weights, up to the fold's rounding."""
    class Fused(Net):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    calls: list[int] = []
    real = torch.nn.utils.clip_grad_norm_

    def counted(*args: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", counted)
    runs = {}
    for name, callbacks in (("folded", []), ("hooked", [_ReadsGrads()])):
        calls.clear()
        plugin = fp16_plugins()[0]
        module = Fused()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[plugin], enable_progress_bar=False,
                            logger=False, enable_model_summary=False, enable_checkpointing=False,
                            num_sanity_val_steps=0, gradient_clip_val=0.05, callbacks=callbacks)
        trainer.fit(module, train_dataloaders=loader(6))
        guard = plugin.guard
        assert guard is not None and guard.step_count == 6
        runs[name] = ([p.detach().clone() for p in module.parameters()], [r.clip_coef for r in guard.history],
                      [r.grad_norm for r in guard.history], len(calls), callbacks)
    folded, f_coefs, f_norms, f_calls, _ = runs["folded"]
    hooked, h_coefs, h_norms, h_calls, (reader,) = runs["hooked"]
    assert f_calls == 0 and h_calls == 6  # folded: torch's clip never ran
    assert all(c < 1.0 for c in f_coefs) and f_coefs == pytest.approx(h_coefs, rel=1e-5)
    assert f_norms == pytest.approx(h_norms, rel=1e-5) == reader.norms  # the hook saw unscaled gradients
    for a, b in zip(folded, hooked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- checkpoints
def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path: Path) -> None:
    """fp16 + step scheduler, NaNs at steps 1 and 4, two epochs of 3 steps, a checkpoint each
    epoch. ``fit(ckpt_path=<epoch 0>)`` in a new Trainer and plugin ends bitwise where the
    uninterrupted run ended: parameters, optimizer, scaler, guard state, scheduler, and the
    guard's reports of the resumed steps."""
    fault = faults.output("layer", "nan", steps=[1, 4])
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    a_plugin = fp16_plugins()[0]
    a_tr, _ = fit(Net(sched=True), plugin=a_plugin, batches=3, epochs=2, fault=fault, callbacks=[ckpt],
                  enable_checkpointing=True)
    first = tmp_path / "epoch=0-step=3.ckpt"
    saved = torch.load(first, weights_only=False)
    assert saved["optimizer_states"][0]["ampguard"]["step"] == 3
    assert saved["optimizer_states"][0]["ampguard"]["skipped_total"] == 1

    b_plugin = fp16_plugins()[0]
    b_tr, _ = fit(Net(sched=True), plugin=b_plugin, batches=3, epochs=2, fault=fault, ckpt_path=str(first))

    assert skipped(a_plugin) == [1, 4] and skipped(b_plugin) == [4]
    assert_same(dict(a_tr.lightning_module.state_dict()), dict(b_tr.lightning_module.state_dict()), "params")
    a_guard, b_guard = a_plugin.guard, b_plugin.guard
    assert a_guard is not None and b_guard is not None
    assert_same(a_guard.state_dict(), b_guard.state_dict(), "guard state")
    assert_same(a_tr.lr_scheduler_configs[0].scheduler.state_dict(),
                b_tr.lr_scheduler_configs[0].scheduler.state_dict(), "scheduler")
    for s in (3, 4, 5):
        ra, rb = a_guard.history[s], b_guard.history[s]
        assert_same((ra.skipped, ra.loss, ra.grad_norm, ra.loss_scale, ra.next_loss_scale),
                    (rb.skipped, rb.loss, rb.grad_norm, rb.loss_scale, rb.next_loss_scale), f"report {s}")


class ShardedNet(Net):
    """:class:`Net` under FSDP2 (``fully_shard`` over the strategy's data-parallel mesh), as
    ``ModelParallelStrategy`` expects it from ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.layer, self.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


@pytest.fixture
def own_process_group():
    """ModelParallelStrategy on one process starts torch.distributed in this process and sets MASTER_PORT and the
    ranks in ``os.environ``, and its teardown leaves both: the next test here (or a subprocess it starts) would find
    them. Destroyed and restored after the test."""
    import os

    import torch.distributed as dist

    environ = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def _full(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


@pytest.mark.usefixtures("own_process_group")
def test_resume_through_model_parallel_strategys_distributed_checkpoint(tmp_path: Path) -> None:
    """``ModelParallelStrategy`` (FSDP2) saves the optimizer with torch's ``get_optimizer_state_dict``, which on the
    guard died at the first checkpoint (``KeyError: 'state'``). Now torch gets the inner optimizer and the guard's
    state rides in the same distributed checkpoint; bf16, a step scheduler, NaNs at steps 1 and 4, a checkpoint each
    epoch: ``fit(ckpt_path=<epoch 0>)`` in a new Trainer ends bitwise where the straight run ended."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    fault = faults.output("layer", "nan", steps=[1, 4])
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    a_plugin = AmpGuardPrecision("bf16-mixed")
    a_tr, _ = fit(ShardedNet(sched=True), plugin=a_plugin, batches=3, epochs=2, fault=fault, callbacks=[ckpt],
                  enable_checkpointing=True, strategy=ModelParallelStrategy())
    first = tmp_path / "epoch=0-step=3.ckpt"
    assert first.is_dir()  # the sharded (distributed) checkpoint

    b_plugin = AmpGuardPrecision("bf16-mixed")
    b_tr, _ = fit(ShardedNet(sched=True), plugin=b_plugin, batches=3, epochs=2, fault=fault, ckpt_path=str(first),
                  strategy=ModelParallelStrategy())
    assert skipped(a_plugin) == [1, 4] and skipped(b_plugin) == [4]
    assert_same(_full(a_tr.lightning_module.state_dict()), _full(b_tr.lightning_module.state_dict()), "params")
    a_guard, b_guard = a_plugin.guard, b_plugin.guard
    assert a_guard is not None and b_guard is not None
    assert a_guard._state_without_optimizer()["ampguard"] == b_guard._state_without_optimizer()["ampguard"]
    assert b_guard.step_count == 6
    for s in (3, 4, 5):
        ra, rb = a_guard.history[s], b_guard.history[s]
        assert_same((ra.skipped, ra.loss, ra.grad_norm), (rb.skipped, rb.loss, rb.grad_norm), f"report {s}")


@pytest.mark.usefixtures("own_process_group")
def test_model_parallel_strategys_full_checkpoint_is_refused_before_training() -> None:
    """The full (rank 0) checkpoint cannot hold the guard's per-rank state: refused when the plugin connects, before
    the guard is built or a step is taken, not at the first checkpoint."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    module, plugin = ShardedNet(), AmpGuardPrecision("bf16-mixed")
    with pytest.raises(NotImplementedError, match="save_distributed_checkpoint=False"):
        fit(module, plugin=plugin, batches=2, strategy=ModelParallelStrategy(save_distributed_checkpoint=False))
    assert module.calls == 0
    assert plugin.guard is None  # refused before the guard was built


def test_resume_a_checkpoint_written_without_the_plugin(tmp_path: Path) -> None:
    """Adding the guard to a running job: Lightning's own fp16 run writes a checkpoint after epoch 0;
    the guarded run resumes from it (plain optimizer state and ``MixedPrecision``'s scaler state
    adopted, guard steps counted from the checkpoint's global step) and ends bitwise where the
    unguarded run ends, skipping the same NaN step (4) that GradScaler skipped. (The NaN at step 1,
    before the checkpoint, halved the scale the checkpoint holds.)"""
    fault = faults.output("layer", "nan", steps=[1, 4])
    guarded_plugin, reference_plugin = fp16_plugins()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    r_tr, _ = fit(Net(), plugin=reference_plugin, batches=3, epochs=2, fault=fault, callbacks=[ckpt],
                  enable_checkpointing=True)
    g_tr, _ = fit(Net(), plugin=guarded_plugin, batches=3, epochs=2, fault=fault,
                  ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))

    guard = guarded_plugin.guard
    assert guard is not None and guard.step_count == 6 and skipped(guarded_plugin) == [4]
    assert_same(dict(g_tr.lightning_module.state_dict()), dict(r_tr.lightning_module.state_dict()), "params")
    assert_same(guard.optimizer.state_dict(), r_tr.optimizers[0].state_dict(), "optimizer")
    assert guard.get_scale() == reference_plugin.scaler.get_scale() == INIT_SCALE / 4  # type: ignore[union-attr]


# ---------------------------------------------------------------------- manual optimization
def test_manual_optimization_skips_nan_steps_without_replay() -> None:
    """``automatic_optimization=False``: ``opt.zero_grad(); self.manual_backward(loss); opt.step()``
    in fp16, NaNs at steps 2 and 3. Both are skipped, bitwise as Lightning's own GradScaler run;
    Lightning's do-nothing closure is never replayed (one ``training_step`` per batch); forensics,
    armed after step 2, names the module on step 3."""
    guarded_plugin, reference_plugin = fp16_plugins()
    fault = faults.output("layer", "nan", steps=[2, 3])
    g_mod, r_mod = Net(manual=True), Net(manual=True)
    _, g = fit(g_mod, plugin=guarded_plugin, batches=6, fault=fault)
    _, r = fit(r_mod, plugin=reference_plugin, batches=6, fault=fault)

    assert skipped(guarded_plugin) == [2, 3]
    assert_same(g.params, r.params, "params")
    assert g_mod.calls == 6
    assert_finite(g_mod)
    guard = guarded_plugin.guard
    assert guard is not None
    by_step = {a.step: a for a in guard.anomalies}
    assert set(by_step) == {2, 3}
    assert by_step[2].module is None  # no replay of the step itself
    assert by_step[3].module == "layer" and by_step[3].phase == "forward"
    assert guard.history[2].loss_scale == INIT_SCALE and guard.history[3].loss_scale == INIT_SCALE / 2


# ---------------------------------------------------------------------- the guard's own clipping, reports
def test_guard_clip_norm_then_validate_and_reports() -> None:
    """``GuardConfig.clip_grad_norm`` clips with the norm the guard measured (the report keeps the
    norm before clipping and the coefficient); after ``fit`` the guard is closed, its reports
    readable, and ``trainer.validate`` runs with the same plugin."""
    plugin = AmpGuardPrecision("bf16-mixed", config={"clip_grad_norm": 0.5})
    trainer, _ = fit(Net(), plugin=plugin, batches=4)
    guard = plugin.guard
    assert guard is not None and guard.step_count == 4
    clipped = [r for r in guard.history if r.clip_coef < 1.0]
    assert clipped and all(r.grad_norm > 0.5 and r.clip_coef == pytest.approx(0.5 / r.grad_norm, rel=1e-4)
                           for r in clipped)
    assert guard.last_report is guard.history[3]
    (metrics,) = trainer.validate(trainer.lightning_module, dataloaders=loader(2), verbose=False)
    assert math.isfinite(metrics["val_loss"])
    assert plugin.guard is guard


def test_example_runs(tmp_path: Path) -> None:
    """examples/lightning_train.py, shortened: fp16 on CPU, both faults skipped, the model learns."""
    spec = importlib.util.spec_from_file_location("lightning_train", ROOT / "examples" / "lightning_train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "summary.json"
    assert example.main(["--steps", "16", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["skipped"] == [5, 12] and summary["scheduler_held"] == 2 and summary["finite"]


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("precision", ["16", "bf16", "32-true", "16-true", "fp16"])
def test_precision_other_than_the_two_is_refused(precision: str) -> None:
    with pytest.raises(ValueError, match=r"use '16-mixed'.*or 'bf16-mixed'"):
        AmpGuardPrecision(precision)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "error", "message"), [
    ({"scaler": torch.amp.GradScaler("cpu")}, ValueError, "bf16 needs no loss scaling"),
    ({"config": "strict"}, TypeError, "config must be a GuardConfig or a dict"),
    ({"config": {"clip_norm": 1.0}}, ValueError, "did you mean 'clip_grad_norm'"),
    ({"exporters": [object()]}, TypeError, "export"),
    ({"free_grads_first": "yes"}, TypeError, "free_grads_first must be a bool"),
])
def test_bad_plugin_arguments_are_refused(kw: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        AmpGuardPrecision("bf16-mixed", **kw)


def test_already_guarded_optimizer_is_refused_before_anything_changes() -> None:
    module = Net(guarded=True)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(GuardStateError, match=r"already guarded.*Return the plain optimizer"):
        fit(module, plugin=AmpGuardPrecision("bf16-mixed"), batches=2)
    assert module.user_guard.step_count == 0 and not module.user_guard.optimizer.state
    assert_same({n: p.detach() for n, p in module.named_parameters()}, before, "params")


@pytest.mark.parametrize(("kw", "message"), [
    ({"optimizers": 2, "manual": True}, "guards one optimizer; configure_optimizers returned 2 .*param groups"),
    ({"lbfgs": True}, "cannot guard LBFGS"),
])
def test_unguardable_optimizers_are_refused(kw: dict[str, Any], message: str) -> None:
    module = Net(**kw)
    plugin = AmpGuardPrecision("bf16-mixed")
    with pytest.raises(ValueError, match=message):
        fit(module, plugin=plugin, batches=2)
    assert plugin.guard is None


def test_clipping_twice_is_refused() -> None:
    plugin = AmpGuardPrecision("bf16-mixed", config={"clip_grad_norm": 1.0})
    with pytest.raises(ValueError, match="would clip twice"):
        fit(Net(), plugin=plugin, batches=2, gradient_clip_val=0.5)
    assert plugin.guard is None


def test_lightning_outside_the_tested_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "__version__", "2.7.0")
    with pytest.raises(IntegrationVersionError, match=r"lightning >=2\.6,<2\.7; 2\.7\.0 is installed"):
        AmpGuardPrecision("bf16-mixed")
    monkeypatch.delitem(sys.modules, "ampguard.integrations.lightning")
    with pytest.raises(IntegrationVersionError, match="pip install 'ampguard\\[lightning\\]'"):
        importlib.import_module("ampguard.integrations.lightning")
