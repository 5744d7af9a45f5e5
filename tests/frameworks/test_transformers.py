"""GuardedTrainer through the real transformers ``Trainer`` (and its real Accelerator), on CPU.

Nothing is mocked. A tiny GPT-2 is built from its config (no download); each run is a few
optimizer steps.

fp16 on CPU: ``Accelerator`` builds a GradScaler and fp16 autocast only on a device that is not
the CPU (``accelerator.py``: ``mixed_precision == "fp16" and device.type != "cpu"`` sets
``native_amp = True`` and ``scaler = get_grad_scaler(...)``, which is ``torch.amp.GradScaler(device_type)``).
On CPU ``TrainingArguments(fp16=True)`` is accepted but trains in fp32 with no scaler. To run the
framework's own fp16 path here, :func:`_fp16_as_on_cuda` sets what ``Accelerator.__init__`` sets
on CUDA, on the Trainer's accelerator, before ``train()`` prepares anything:
``accelerator.scaler = torch.amp.GradScaler("cpu")`` and ``accelerator.native_amp = True``. From
there the code paths are CUDA's: ``prepare_model`` wraps ``forward`` in ``autocast(dtype=float16)``
(the state's mixed_precision is "fp16"), ``prepare_optimizer`` hands the scaler to the
``AcceleratedOptimizer``, ``accelerator.backward`` runs ``scaler.scale(loss).backward()``,
``clip_grad_norm_`` unscales through ``scaler.unscale_``, the Trainer saves and loads ``scaler.pt``.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import ampguard
from ampguard import faults
from ampguard.integrations._versions import IntegrationVersionError
from ampguard.integrations.transformers import GuardedTrainer

pytestmark = pytest.mark.frameworks

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("bf16", "fp16")
LAYER = "transformer.h.0.mlp"  # a module whose output the faults poison


# ------------------------------------------------------------------------------ helpers
def _model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, 50, (n, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: Path, precision: str, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=7, data_seed=11, bf16=precision == "bf16",
        fp16=precision == "fp16",
    )
    base.update(kw)
    return TrainingArguments(**base)


def _fp16_as_on_cuda(trainer: Trainer) -> None:
    """What ``Accelerator.__init__`` sets for fp16 on CUDA, with the CPU's GradScaler (module docstring)."""
    acc = trainer.accelerator
    assert acc.mixed_precision == "fp16" and acc.scaler is None and not acc.native_amp  # accelerate's CPU choice
    acc.scaler = torch.amp.GradScaler("cpu")
    acc.native_amp = True


class _Inject(TrainerCallback):  # type: ignore[misc]
    """Puts NaN into ``LAYER``'s output at the given guard steps, once the guard exists."""

    def __init__(self, trainer_ref: list[Trainer], steps: tuple[int, ...]) -> None:
        self.trainer_ref, self.steps = trainer_ref, steps
        self.injection: faults.Injection | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer_ref[0]
        assert isinstance(trainer, GuardedTrainer) and trainer.guard is not None
        self.injection = faults.inject(trainer.guard, trainer.model, faults.output(LAYER, "nan", steps=self.steps))


def _trainer(out: Path, precision: str, *, guarded: bool = True, nan_steps: tuple[int, ...] = (), seed: int = 0,
             guard_config: dict[str, Any] | None = None, **kw: Any) -> tuple[Trainer, _Inject | None]:
    ref: list[Trainer] = []
    inject = _Inject(ref, nan_steps) if nan_steps else None
    extra = {"guard_config": guard_config} if guarded else {}
    cls = GuardedTrainer if guarded else Trainer
    trainer = cls(model=_model(seed), args=_args(out, precision, **kw), train_dataset=_Tokens(),
                  callbacks=[inject] if inject else None, **extra)
    ref.append(trainer)
    if precision == "fp16":
        _fp16_as_on_cuda(trainer)
    return trainer, inject


def _train_logs(trainer: Trainer) -> list[dict[str, Any]]:
    return [h for h in trainer.state.log_history if "loss" in h]


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _inner(trainer: Trainer) -> torch.optim.Optimizer:
    opt = trainer.optimizer
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def _opt_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    inner = _inner(trainer)
    return {f"{i}.{k}": v.clone() for i, st in enumerate(inner.state.values()) for k, v in st.items()
            if isinstance(v, torch.Tensor)}


# ------------------------------------------------------------------------------ skipping, scheduler, logs
@pytest.mark.parametrize("precision", PRECISIONS)
def test_nonfinite_steps_are_skipped_and_the_scheduler_holds(tmp_path: Path, precision: str) -> None:
    nan_steps = (2, 4)
    trainer, inject = _trainer(tmp_path, precision, nan_steps=nan_steps)
    trainer.train()
    guard = trainer.guard
    assert guard is not None and inject is not None and inject.injection is not None
    assert guard.precision == precision and (guard.scaler is trainer.accelerator.scaler)
    assert sorted({s for s, _, _ in inject.injection.fired}) == list(nan_steps)

    reports = list(guard.history)
    assert [r.step for r in reports] == list(range(6))
    skipped = [r.step for r in reports if r.skipped]
    assert skipped == list(nan_steps) and guard.skipped_steps == len(nan_steps)
    for p in trainer.model.parameters():
        assert torch.isfinite(p).all()

    logs = _train_logs(trainer)
    assert [h["step"] for h in logs] == [1, 2, 3, 4, 5, 6]
    # the log keys, per optimizer step: the skip count so far and the scale the next step runs at
    assert [h["skipped_steps"] for h in logs] == [sum(s <= i for s in nan_steps) for i in range(6)]
    assert [h["loss_scale"] for h in logs] == [r.next_loss_scale for r in reports]
    if precision == "fp16":
        assert [h["loss_scale"] for h in logs] == [65536.0] * 2 + [32768.0] * 2 + [16384.0] * 2
    else:
        assert all(h["loss_scale"] == 1.0 for h in logs)
    final = trainer.state.log_history[-1]
    assert final["skipped_steps"] == len(nan_steps) and "train_loss" in final

    # the scheduler stepped on taken steps only: linear decay over max_steps, by taken steps
    lrs = [h["learning_rate"] for h in logs]
    taken = [sum(not r.skipped for r in reports[:i]) for i in range(6)]
    assert lrs == pytest.approx([1e-3 * (1 - t / 6) for t in taken], rel=1e-12)
    assert trainer.lr_scheduler.last_epoch == 6 - len(nan_steps)
    assert trainer.accelerator.optimizer_step_was_skipped is False  # the last step was taken

    # the reported loss is the optimizer step's: the sum of the micro-batch losses as the Trainer
    # back-propagated them (each divided by the 2 accumulation steps), the number it logs as "loss"
    taken_steps = [r for r in reports if not r.skipped]
    assert [r.loss for r in taken_steps] == pytest.approx([logs[r.step]["loss"] for r in taken_steps], rel=1e-6)
    assert all(3.0 < r.loss < 4.5 for r in taken_steps)  # cross-entropy over 50 tokens (ln 50 = 3.9), not half
    assert all(math.isnan(reports[s].loss) for s in nan_steps)


# ------------------------------------------------------------------------------ parity with the plain Trainer
@pytest.mark.parametrize("precision", PRECISIONS)
def test_healthy_run_matches_the_plain_trainer_bit_for_bit(tmp_path: Path, precision: str) -> None:
    """Accumulation (2 micro-batches) and clipping (max_grad_norm below every norm, so every step
    clips): same parameters and optimizer state as the plain Trainer, bitwise; the guard's
    grad_norm is the norm before clipping."""
    # optim="adamw_torch" (not fused): bitwise needs the guard's clip to fall back to unscale_ + torch's
    # clip_grad_norm_; with a fused optimizer it is folded into grad_scale (equal within float rounding,
    # tests/frameworks/test_fused_clip.py).
    kw = dict(max_steps=4, max_grad_norm=0.25, optim="adamw_torch")
    plain, _ = _trainer(tmp_path / "plain", precision, guarded=False, **kw)
    plain.train()
    guarded, _ = _trainer(tmp_path / "guarded", precision, **kw)
    guarded.train()
    assert guarded.guard is not None and guarded.guard.skipped_steps == 0

    _assert_same_tensors(_params(plain), _params(guarded))
    _assert_same_tensors(_opt_state(plain), _opt_state(guarded))
    plain_logs, logs = _train_logs(plain), _train_logs(guarded)
    assert [h["loss"] for h in logs] == [h["loss"] for h in plain_logs]
    assert [h["grad_norm"] for h in logs] == [h["grad_norm"] for h in plain_logs]
    assert [h["learning_rate"] for h in logs] == [h["learning_rate"] for h in plain_logs]
    norms = [r.grad_norm for r in guarded.guard.history]
    assert min(norms) > 0.25  # so every step was clipped, and the guard saw the norm before it
    assert norms == pytest.approx([h["grad_norm"] for h in logs], rel=1e-5)
    if precision == "fp16":
        assert plain.accelerator.scaler.get_scale() == guarded.guard.get_scale()


def test_without_clipping_the_logged_norm_is_the_guards_measurement_and_nothing_is_unscaled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26's row without clipping: with ``max_grad_norm=0`` transformers 5 still calls
    ``accelerator.clip_grad_norm_(model.parameters(), inf)`` every step, for the norm it logs. In fp16 with a fused
    AdamW the guard answers from its own measurement of the still-scaled gradients: no unscale (accelerate's answer
    unscales, takes the norm and multiplies every gradient by 1), the same logged norms and losses as the plain
    Trainer, and the same training within float rounding (the fused kernel unscales instead of ``unscale_``).
    Before, every step unscaled (the inf clip was left to accelerate)."""
    kw = dict(max_steps=4, max_grad_norm=0.0, optim="adamw_torch_fused", gradient_accumulation_steps=1)
    plain, _ = _trainer(tmp_path / "plain", "fp16", guarded=False, **kw)
    plain.train()
    unscaled = {"n": 0}
    unscale_ = ampguard.GuardedOptimizer.unscale_

    def counted(self: ampguard.GuardedOptimizer) -> None:
        unscaled["n"] += 1
        unscale_(self)

    monkeypatch.setattr(ampguard.GuardedOptimizer, "unscale_", counted)
    guarded, _ = _trainer(tmp_path / "guarded", "fp16", **kw)
    guarded.train()
    assert guarded.guard is not None and guarded.guard.skipped_steps == 0 and guarded.guard.step_count == 4
    assert unscaled["n"] == 0
    plain_logs, logs = _train_logs(plain), _train_logs(guarded)
    assert [h["loss"] for h in logs] == pytest.approx([h["loss"] for h in plain_logs], rel=1e-4)
    assert [h["grad_norm"] for h in logs] == pytest.approx([h["grad_norm"] for h in plain_logs], rel=1e-5)
    assert [r.grad_norm for r in guarded.guard.history] == pytest.approx([h["grad_norm"] for h in logs], rel=1e-5)
    assert all(r.clip_coef == 1.0 for r in guarded.guard.history)
    want, got = _params(plain), _params(guarded)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ resume
def _as_fsdp2(trainer: Trainer) -> None:
    """The Trainer's FSDP2 checkpoint branches (``save_fsdp_model``/``save_fsdp_optimizer`` and their loads, DCP),
    switched on as the Trainer switches them on with an ``fsdp`` config on CUDA (accelerate turns FSDP on only for
    GPU-like devices); the model itself stays unsharded on one process, which torch's state-dict functions take."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    trainer.is_fsdp_enabled = True
    trainer.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_through_the_trainers_fsdp_checkpoint(tmp_path: Path, precision: str) -> None:
    """Under FSDP the Trainer saves the optimizer with accelerate's ``save_fsdp_optimizer``, which hands it to torch's
    ``get_optimizer_state_dict``: with the guard there it died (``KeyError: 'state'``). Now the inner optimizer goes
    to DCP and the guard's state beside it; resumed from step 3 by a new trainer, the run ends bit for bit where the
    straight run ends, the guard's counters (a NaN at step 1 and one at step 4) and the scale included."""
    straight, _ = _trainer(tmp_path, precision, nan_steps=(1, 4), save_strategy="steps", save_steps=3)
    _as_fsdp2(straight)
    straight.train()
    checkpoint = tmp_path / "checkpoint-3"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"ampguard_0_rank0.pt", "optimizer_0", "pytorch_model_fsdp_0"} <= files, files
    resumed, _ = _trainer(tmp_path / "resumed", precision, nan_steps=(1, 4), seed=123)
    _as_fsdp2(resumed)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    _assert_resumed_as_straight(straight, resumed)


def _assert_resumed_as_straight(straight: Trainer, resumed: Trainer) -> None:
    """6 steps, a NaN at guard steps 1 and 4: the same parameters, optimizer state, guard state and scaler."""
    a, b = straight.guard, resumed.guard
    assert a is not None and b is not None
    _assert_same_tensors(_params(straight), _params(resumed))
    _assert_same_tensors(_opt_state(straight), _opt_state(resumed))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["ampguard"] == sb["ampguard"] and sa["scaler"] == sb["scaler"]
    assert sa["ampguard"]["step"] == 6 and sa["ampguard"]["skipped_total"] == 2


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_from_checkpoint_continues_bit_for_bit(tmp_path: Path, precision: str) -> None:
    """6 steps straight (checkpoint after step 3) against: a NEW trainer, with a differently
    initialised model, resumed from that checkpoint to step 6. A NaN before the checkpoint
    (guard step 1) and one after it (step 4) exercise the scale and the guard's counters.

    Forensics is on (the default): the straight run has it armed since step 1 when step 4 goes NaN,
    the resumed run does not, and they must still agree (forensics only looks)."""
    config: dict[str, bool] = {}
    straight, _ = _trainer(tmp_path, precision, nan_steps=(1, 4), save_strategy="steps", save_steps=3,
                           guard_config=config)
    straight.train()
    checkpoint = tmp_path / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert set(saved) == {"optimizer", "scaler", "ampguard"} and saved["ampguard"]["step"] == 3
    assert saved["ampguard"]["skipped_total"] == 1

    resumed, _ = _trainer(tmp_path / "resumed", precision, nan_steps=(1, 4), seed=123, guard_config=config)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    _assert_resumed_as_straight(straight, resumed)
    a, b = straight.guard, resumed.guard
    assert a is not None and b is not None
    assert straight.lr_scheduler.state_dict() == resumed.lr_scheduler.state_dict()
    # the steps after the checkpoint: the same decisions, losses and norms, bit for bit
    def key(r: ampguard.StepReport) -> str:
        return repr((r.step, r.skipped, r.loss, r.grad_norm, r.loss_scale))  # repr: NaN == NaN

    assert [key(r) for r in b.history] == [key(r) for r in list(a.history)[3:]]
    keys = ("loss", "learning_rate", "loss_scale", "skipped_steps")
    assert repr([[h[k] for k in keys] for h in _train_logs(resumed)[3:]]) == \
           repr([[h[k] for k in keys] for h in _train_logs(straight)[3:]])


def test_the_exporters_hold_every_step_when_train_returns(tmp_path: Path) -> None:
    """A JSONL log read after ``trainer.train()`` (no ``close()``: the guard stays open for another ``train()``).
    Healthy reports wait for their batch before they are exported: before stop 51 the log missed the steps still
    waiting when ``train()`` returned (here step 20; with ``logging_steps=50``, steps 16-20), and at exit too."""
    import json

    from ampguard.exporters import JsonlExporter

    log = tmp_path / "guard.jsonl"
    trainer = GuardedTrainer(model=_model(), args=_args(tmp_path, "bf16", max_steps=21, gradient_accumulation_steps=1),
                             train_dataset=_Tokens(), guard_exporters=[JsonlExporter(log)])
    trainer.train()
    assert trainer.guard is not None and not trainer.guard._closed
    steps = [e["step"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "step"]
    assert steps == list(range(21))
    trainer.guard.close()


def test_train_with_model_init_again_ends_the_last_runs_guard(tmp_path: Path) -> None:
    """``train()`` with ``model_init`` reloads the model and builds a new optimizer each time (transformers'
    hyperparameter search does this per trial): a new guard, a new run. Before stop 51 the last run's guard stayed
    open beside it, writing into the same exporters the new guard had reopened; now it is closed first: the JSONL log
    holds each run whole, its close event before the next run's header."""
    import json

    from ampguard.exporters import JsonlExporter

    log = tmp_path / "guard.jsonl"
    args = _args(tmp_path, "bf16", max_steps=3, gradient_accumulation_steps=1)
    trainer = GuardedTrainer(model_init=lambda: _model(), args=args, train_dataset=_Tokens(),
                             guard_exporters=[JsonlExporter(log)])
    trainer.train()
    first = trainer.guard
    trainer.train()
    assert first is not None and first._closed and trainer.guard is not first and not trainer.guard._closed
    trainer.guard.close()
    events = [e["event"] for e in map(json.loads, log.read_text().splitlines())]
    assert events == ["run", "step", "step", "step", "close"] * 2


def test_forensics_leaves_the_dropout_rng_alone(tmp_path: Path) -> None:
    """Forensics only looks: a run whose second NaN step is examined by armed forensics hooks
    trains exactly as the same run with forensics off (GPT-2 has dropout: the RNG must not move)."""
    runs = []
    for forensics in (True, False):
        trainer, _ = _trainer(tmp_path / str(forensics), "bf16", nan_steps=(1, 4),
                              guard_config={"forensics": forensics})
        trainer.train()
        runs.append(_params(trainer))
    _assert_same_tensors(*runs)


# ------------------------------------------------------------------------------ bad input
def test_an_already_guarded_optimizer_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model = _model()
    guarded = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16")
    rng = torch.get_rng_state()
    with pytest.raises(ampguard.GuardStateError, match=r"pass the plain optimizer.*opt\.optimizer"):
        GuardedTrainer(model=model, args=_args(tmp_path, "bf16"), train_dataset=_Tokens(), optimizers=(guarded, None))
    assert torch.equal(rng, torch.get_rng_state())  # the Trainer's set_seed() did not run
    # the plain optimizer inside it is accepted (its scheduler: the Trainer's default)
    guarded.close()
    trainer = GuardedTrainer(model=model, args=_args(tmp_path, "bf16", max_steps=1), train_dataset=_Tokens(),
                             optimizers=(guarded.optimizer, None))
    trainer.train()
    assert trainer.guard is not None and trainer.guard.optimizer is guarded.optimizer
    assert trainer.guard.step_count == 1


def test_an_untested_transformers_is_refused_naming_the_range(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the module object require() imports (transformers swaps its lazy module in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")
    model, args = _model(), _args(tmp_path, "bf16")
    rng = torch.get_rng_state()
    with pytest.raises(IntegrationVersionError, match=r"transformers >=5\.17,<5\.25.*5\.99\.0"):
        GuardedTrainer(model=model, args=args, train_dataset=_Tokens())
    assert torch.equal(rng, torch.get_rng_state())


def test_clipping_in_two_places_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"clip twice.*max_grad_norm=0"):
        GuardedTrainer(model=_model(), args=_args(tmp_path, "bf16"), train_dataset=_Tokens(),
                       guard_config={"clip_grad_norm": 1.0})
    with pytest.raises(ValueError, match=r"unknown GuardConfig key.*'hysteresis'"):
        GuardedTrainer(model=_model(), args=_args(tmp_path, "bf16"), train_dataset=_Tokens(),
                       guard_config={"hysterisis": 2})


# ------------------------------------------------------------------------------ the example
def test_example_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--steps", "6",
                           "--output-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "skipped steps: [3]" in proc.stdout
    words = proc.stdout.strip().splitlines()[-1].split()  # first loss <x> final loss <y>
    assert float(words[-1]) < float(words[2])
