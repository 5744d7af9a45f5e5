#!/usr/bin/env python
"""What each framework integration costs per optimizer step, against the same framework's own fp16
loop without the guard. All arms side by side in one process, interleaved block by block.

Arms (each its own copy of one GPT-2: same ``GPT2Config``, same initial weights, same token batches;
dropout off so every arm computes the same numbers, fp16 with loss scaling, fused AdamW where the
framework permits it):

  accelerate_plain    ``Accelerator(mixed_precision="fp16")``; ``prepare(model, optimizer, scheduler)``;
                      the documented loop: forward, ``accelerator.backward``, ``accelerator.clip_grad_norm_(1.0)``,
                      ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``. Fused AdamW.
  accelerate_guarded  + ``optimizer = ampguard.wrap(optimizer, accelerator=accelerator, model=model)``.
  trainer_plain       transformers ``Trainer``, its own ``train()`` loop: ``TrainingArguments(fp16=True,
                      optim="adamw_torch_fused", max_grad_norm=1.0)``, its linear scheduler; no logging, no saving.
  trainer_guarded     ``GuardedTrainer``, the same arguments.
  transformers_noclip the two Trainer arms with ``max_grad_norm=0`` (not in the default ``--frameworks``): no clip,
                      but transformers 5 still asks ``accelerator.clip_grad_norm_(params, inf)`` for the norm it
                      logs, every step.
  lightning_plain     ``lightning.Trainer(precision="16-mixed")``, its own ``fit()`` loop; fused AdamW, a
                      ``LambdaLR`` with ``interval="step"``; no clipping (Lightning's own ``MixedPrecision``
                      refuses to clip a fused optimizer, so neither arm clips).
  lightning_guarded   ``Trainer(plugins=[AmpGuardPrecision("16-mixed")])``, the same module.

Gradient accumulation 1. The accelerate arms read batches from a plain ``DataLoader`` and move them with
``.to(device)`` (a prepared ``DataLoaderShard`` would register in accelerate's process-wide
``GradientState``, which the four accelerate-based arms share here); the Trainer and Lightning arms use
their own data loading.

Timing (the method of ``overhead.py``, adapted to loops that are not ours): every arm runs its framework's
own loop ONCE, for (warm-up + timed + spare) blocks of ``--block`` optimizer steps, each loop in its own
thread. The threads take turns: only one runs at a time while the others wait on an Event, so the
loops are interleaved block by block in one process. A callback at the end of every optimizer step
(``TrainerCallback.on_step_end``, ``Callback.on_train_batch_end``, the end of our accelerate iteration)
counts steps; at each block edge the device is synchronised, the time taken, and the thread hands back.
A round runs one block of every arm, in an order rotated per round; one block's time / ``--block`` is
one sample. The first ``--warmup`` rounds are discarded (the first holds each loop's own setup:
``prepare``, data loader, first steps, the guard's CUDA-graph capture). Reported per arm: median,
p25/p75, min/max of the samples; per framework: the ratio of medians guarded/plain (the headline,
against the 1.01 target) and the median of the per-round ratios (each guarded block against the plain
block of the same round). What is timed is the loop between block edges: forward, backward, clipping,
optimizer and scheduler steps, the framework's per-step bookkeeping and data loading; not the setup
before the first step.

``--isolate`` (stop 65): each arm in its own process, started with ``spawn``, the rounds as above with the turns
handed over a pipe. In one process the six loops share the CUDA caching allocator, and each loop's gradients took
new places between its turns: on an H100 (stop 65, ``benchmarks/results/gpu_stop65/frameworks_now.txt``) every
guarded arm captured its graph again every round (23 captures in 23 rounds), so each of its timed blocks held a capture
and eager first sightings that a single training loop pays once. Apart, each loop's allocations are its own. Each
process builds the same model from the same seed; the accelerate sync count stays in the controller.

On CUDA also (before the timing, with fresh models): host-device syncs per accelerate step, counted
per step over 4 steps after 12 warm-up steps (``torch.cuda.set_sync_debug_mode("warn")`` warnings plus
``torch.cuda.Event.synchronize`` calls, which the debug mode does not see) for the plain loop, the
guarded loop, and the guarded loop without a scheduler. Until stop 47 the prepared scheduler read
``optimizer.step_was_skipped`` every step, which waited for the guard's decision: the difference
between the last two is what a held scheduler adds (0 since the guard steps it).

    python benchmarks/frameworks_cost.py --device cuda --out benchmarks/results/frameworks_cost.json
    python benchmarks/frameworks_cost.py --quick --device cpu      # tiny GPT-2, a smoke run of the harness

On CPU the fp16 arms use the stand-ins of ``tests/frameworks`` (accelerate and the Trainer build no
GradScaler and no fp16 autocast on CPU: the benchmark sets ``native_amp``/``scaler`` as
``Accelerator.__init__`` does on CUDA; Lightning gets ``MixedPrecision("16-mixed", "cpu", scaler)``):
the CPU numbers check the harness, not the cost.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

# the tree's root after PYTHONPATH: a library named there runs (gpu_issue26.sh FW_BASE=REV puts that commit's first;
# inserted first, as until stop 54, the tree's own ran in both arms of that comparison)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from overhead import EventSyncCounter  # benchmarks/ is sys.path[0] when run as a script

import ampguard

FRAMEWORKS = ("accelerate", "transformers", "lightning", "transformers_noclip")
"""What ``--frameworks`` may name; ``transformers_noclip`` (the Trainer with ``max_grad_norm=0``: issue 26's row
without clipping) is not in the default."""
TARGET = 1.00
TARGETS = {"transformers_noclip": 1.005, "lightning": 1.005}
"""Issue 26's targets: 1.00 with clipping, 1.005 without. The Lightning arms do not clip (Lightning's own
``MixedPrecision`` refuses to clip a fused optimizer), so theirs is the row without clipping."""
"""Issue 26: inside each framework, with clipping, at most 1.00x the framework's own fp16 loop; without, 1.005x."""
CLIP = 1.0
LR, WD = 1e-4, 0.1
SYNC_WARMUP, SYNC_STEPS = 12, 4
"""The host-sync count: steps before it (3 until stop 48: the guard's first steps capture its graphs) and steps
counted (per step: their mean)."""

SIZES: dict[str, dict[str, int]] = {
    # GPT-2 small: GPT2Config()'s 12 layers, 768 wide, 12 heads, 50257 tokens (124M parameters, tied head)
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq=256, batch=8),
    "tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, seq=32, batch=4),
}


# ---------------------------------------------------------------------------------------- model, data
def build_model(size: dict[str, int], device: torch.device) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=size["n_layer"], n_embd=size["n_embd"], n_head=size["n_head"],
                        vocab_size=size["vocab_size"], n_positions=max(1024, size["seq"]), resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=min(50256, size["vocab_size"] - 1),
                        eos_token_id=min(50256, size["vocab_size"] - 1))
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(device)  # built on the CPU (its RNG), then moved: the same weights anywhere


class Tokens(Dataset):  # type: ignore[type-arg]
    """``rows`` rows of ``seq`` random tokens, the same for every arm."""

    def __init__(self, rows: int, size: dict[str, int]) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, size["vocab_size"], (rows, size["seq"]), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arms_context(device: torch.device, size: dict[str, int], tmpdir: str, total_steps: int) -> dict[str, Any]:
    """What the arms' builders read (``BUILDERS``): the device, the model's size, a scratch folder, the steps a loop may
    take and their tokens. The controller's, and each ``--isolate`` process's own."""
    return {"device": device, "size": size, "tmpdir": tmpdir, "total_steps": total_steps,
            "dataset": Tokens(total_steps * size["batch"], size)}


CLOCK = ["wall"]
"""``--clock``: "wall" (``time.perf_counter`` from the controller's go to the block edge, the device synchronised), or
"thread": the arm's own thread's CPU time over its turn (``time.thread_time``, from the go it woke on to the block
edge): the loop's host work alone, which another process's time on the core does not enter. On CUDA it includes the
host's spin in each wait for the device (a sync, an ``item``): the host-bound case, not the device's time. On the CPU
it is the whole loop's, and quiet (stop 68)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- interleaving
class Arm:
    """One framework loop in its own thread, run ``block`` optimizer steps at a time."""

    def __init__(self, name: str, framework: str, guarded: bool, block: int, device: torch.device) -> None:
        self.name, self.framework, self.guarded = name, framework, guarded
        self.block, self.device = block, device
        self.body: Callable[[Arm], None] = lambda arm: None
        self.times: list[float | None] = []  # seconds per step, per round; None where the loop had ended
        self.steps = 0
        self.stop = False  # set by the controller: the loop ends at its next step
        self.finished = False
        self.error: str | None = None
        self.info: dict[str, Any] = {}
        self._go = threading.Event()
        self._parked = threading.Event()
        self._t_edge = 0.0
        self._c_go = self._c_edge = 0.0  # --clock thread: the arm thread's CPU time at its go and at its block edge
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = False
        self.profile: Any = None
        """``--pstats``: a ``cProfile.Profile`` on while the arm's thread runs its blocks, off while it is parked
        (Python 3.11 profiles one thread; from 3.12 cProfile is process-wide and one may be on at a time)."""

    def _main(self) -> None:
        self._go.wait()
        self._go.clear()
        self._c_go = time.thread_time()
        try:
            if self.profile is not None:
                self.profile.enable()
            self.body(self)
        except BaseException:
            self.error = traceback.format_exc()[-3000:]
        finally:
            if self.profile is not None:
                self.profile.disable()
            self.finished = True
            self._parked.set()

    def step_done(self) -> bool:
        """In the arm's thread, after every optimizer step. At a block edge: synchronise, note the time,
        hand back and wait for the next turn. Returns True when the loop should stop."""
        self.steps += 1
        if self.steps % self.block == 0 and not self.stop:
            sync(self.device)
            self._t_edge = time.perf_counter()
            self._c_edge = time.thread_time()
            if self.profile is not None:
                self.profile.disable()
            self._parked.set()
            self._go.wait()
            self._go.clear()
            self._c_go = time.thread_time()
            if self.profile is not None:
                self.profile.enable()
        if self.stop and self.profile is not None:
            # the framework's teardown that follows is no step's (stop 53: Lightning's model.cpu() at the end of fit,
            # its 298 tensors, read as 3.31 device waits a step)
            self.profile.disable()
        return self.stop

    def run_block(self) -> float | None:
        """In the controller: let the arm run one block; its time, or None if its loop has ended."""
        if self.finished:
            return None
        sync(self.device)
        t0 = time.perf_counter()
        self._parked.clear()
        if not self._started:
            self._started = True
            self._thread.start()
        self._go.set()
        self._parked.wait()
        if self.finished:
            return None
        return self._c_edge - self._c_go if CLOCK[0] == "thread" else self._t_edge - t0

    def end(self, timeout: float = 120.0) -> None:
        """Let the loop finish its current step and return (the framework's own teardown runs)."""
        self.stop = True
        if self._started and not self.finished:
            self._parked.clear()
            self._go.set()
            self._parked.wait(timeout)
            self._thread.join(timeout)


class IsolatedArm:
    """``--isolate``: the controller's side of an :class:`Arm` that runs in its own process (:func:`_isolated`): the
    same ``run_block``/``end`` and the fields the summary reads."""

    def __init__(self, name: str, framework: str, guarded: bool, block: int, device: torch.device,
                 setup: dict[str, Any]) -> None:
        import multiprocessing

        self.name, self.framework, self.guarded = name, framework, guarded
        self.times: list[float | None] = []
        self.steps = 0
        self.finished = False
        self.error: str | None = None
        self.entry: dict[str, Any] = {}
        """The guard's figures, as :func:`guard_entry` makes them in the arm's process."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_isolated, args=(child, name, framework, guarded, block, str(device), setup),
                                 name=name, daemon=True)
        self._proc.start()  # the arms' processes build their loops side by side: wait_ready() waits for one

    def wait_ready(self) -> None:
        kind, detail = self._conn.recv()  # "ready", or "error" with the builder's traceback
        if kind != "ready":
            self.error, self.finished = detail, True
            self._proc.join(30)

    def run_block(self) -> float | None:
        if self.finished:
            return None
        self._conn.send("go")
        t = self._conn.recv()
        if t is None:
            self.finished = True
        return t

    def end(self, timeout: float = 120.0) -> None:
        if self._proc.is_alive():
            self._conn.send("end")
            if self._conn.poll(timeout):
                self.steps, error, self.entry = self._conn.recv()
                self.error = self.error or error
            self._proc.join(timeout)
        self.finished = True


def _isolated(conn: Any, name: str, framework: str, guarded: bool, block: int, device_name: str,
              setup: dict[str, Any]) -> None:
    """An arm's process (``--isolate``): build the model and the loop as the controller would, then run a block
    on each "go" (its time back, None once the loop has ended) until "end" (its steps, error and guard figures)."""
    CLOCK[0] = setup.get("clock", "wall")
    device = torch.device(device_name)
    try:
        base = build_model(setup["size"], device)
        ctx = arms_context(device, setup["size"], tempfile.mkdtemp(prefix=name), setup["total_steps"])
        if framework.startswith(("accelerate", "transformers")):
            _fresh_accelerate_state()
        arm = Arm(name, framework, guarded, block, device)
        BUILDERS[framework](arm, base, ctx)
    except Exception:
        conn.send(("error", traceback.format_exc()[-3000:]))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg == "go":
            conn.send(arm.run_block())
            continue
        arm.end()
        conn.send((arm.steps, arm.error, guard_entry(arm)))
        return


def guard_entry(arm: Arm) -> dict[str, Any]:
    """An arm's end: its steps and final loss scale; a guarded arm's steps, skips and graphs' counts (its guard
    closed)."""
    scaler = arm.info.get("scaler")
    entry: dict[str, Any] = {"steps": arm.steps, "pid": os.getpid(),
                             "final_loss_scale": float(scaler.get_scale()) if scaler is not None else None}
    guard = arm.info.get("guard")
    if guard is not None:
        entry.update(guard_steps=guard.step_count, skipped_steps=guard.skipped_steps)
        pipe = guard._pipeline  # the graphs' counts: a measurement run eagerly costs the host ~2.6 us a tensor
        for name, graphs in (("measure_graph", pipe.measure_graph), ("step_graph", pipe.step_graph)):
            entry[name] = {"captures": graphs.captures, "replays": graphs.replays}
        if not guard._closed:
            guard.close()
    return entry


# ---------------------------------------------------------------------------------------- the arms
def _fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _cpu_fp16_as_on_cuda(accelerator: Any) -> None:
    """What ``Accelerator.__init__`` sets for fp16 on CUDA, with the CPU's GradScaler (CPU smoke runs)."""
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")


def build_accelerate(arm: Arm, model: torch.nn.Module, ctx: dict[str, Any], *, scheduler: bool = True) -> Any:
    """Prepared accelerate objects; ``arm.body`` is the documented loop."""
    from accelerate import Accelerator

    device: torch.device = ctx["device"]
    acc = Accelerator(mixed_precision="fp16", cpu=device.type == "cpu")
    if device.type == "cpu":
        _cpu_fp16_as_on_cuda(acc)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    total = ctx["total_steps"]
    objs: list[Any] = [model, opt]
    if scheduler:
        objs.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda n: max(0.0, 1.0 - n / total)))
    prepared = acc.prepare(*objs)
    model, opt = prepared[0], prepared[1]
    sched = prepared[2] if scheduler else None
    if arm.guarded:
        opt = ampguard.wrap(opt, accelerator=acc, model=model)
        arm.info["guard"] = opt.guard
    arm.info["scaler"] = acc.scaler
    loader = DataLoader(ctx["dataset"], batch_size=ctx["size"]["batch"], pin_memory=device.type == "cuda")

    def step(batch: dict[str, torch.Tensor]) -> None:
        x = batch["input_ids"].to(acc.device, non_blocking=True)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()

    def body(arm: Arm) -> None:
        while True:
            for batch in loader:
                step(batch)
                if arm.step_done():
                    return

    arm.body = body
    return step, loader


def build_trainer(arm: Arm, model: torch.nn.Module, ctx: dict[str, Any], clip: float = CLIP) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    device: torch.device = ctx["device"]
    args = TrainingArguments(
        output_dir=os.path.join(ctx["tmpdir"], arm.name), max_steps=ctx["total_steps"],
        per_device_train_batch_size=ctx["size"]["batch"], gradient_accumulation_steps=1, fp16=True,
        optim="adamw_torch_fused", learning_rate=LR, weight_decay=WD, max_grad_norm=clip, logging_strategy="no",
        save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=device.type == "cpu",
    )

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if arm.step_done():
                control.should_training_stop = True
            return control

    if arm.guarded:
        from ampguard.integrations.transformers import GuardedTrainer

        trainer: Any = GuardedTrainer(model=model, args=args, train_dataset=ctx["dataset"], callbacks=[Clock()])
    else:
        trainer = Trainer(model=model, args=args, train_dataset=ctx["dataset"], callbacks=[Clock()])
    if device.type == "cpu":
        _cpu_fp16_as_on_cuda(trainer.accelerator)
    arm.info["trainer"] = trainer

    def body(arm: Arm) -> None:
        trainer.train()
        arm.info["guard"] = getattr(trainer, "guard", None)
        arm.info["scaler"] = trainer.accelerator.scaler

    arm.body = body


def build_lightning(arm: Arm, model: torch.nn.Module, ctx: dict[str, Any]) -> None:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    device: torch.device = ctx["device"]
    total = ctx["total_steps"]

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD, fused=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: max(0.0, 1.0 - n / total))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if arm.step_done():
                trainer.should_stop = True

    kw: dict[str, Any] = {}
    if arm.guarded:
        from ampguard.integrations.lightning import AmpGuardPrecision

        scaler = torch.amp.GradScaler("cpu") if device.type == "cpu" else None
        kw["plugins"] = [AmpGuardPrecision("16-mixed", device="cpu" if device.type == "cpu" else None, scaler=scaler)]
    elif device.type == "cpu":  # Lightning turns "16-mixed" into bf16 on CPU: build the fp16 plugin
        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    else:
        kw["precision"] = "16-mixed"
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=total,
                        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=os.path.join(ctx["tmpdir"], arm.name), callbacks=[Clock()], **kw)
    module = LitGPT()
    loader = DataLoader(ctx["dataset"], batch_size=ctx["size"]["batch"], pin_memory=device.type == "cuda")

    def body(arm: Arm) -> None:
        trainer.fit(module, train_dataloaders=loader)
        plugin = trainer.precision_plugin
        arm.info["guard"] = getattr(plugin, "guard", None)
        arm.info["scaler"] = plugin.scaler

    arm.body = body


BUILDERS: dict[str, Callable[..., Any]] = {
    "accelerate": build_accelerate,
    "transformers": build_trainer,
    "lightning": build_lightning,
    "transformers_noclip": functools.partial(build_trainer, clip=0.0),
}


# ---------------------------------------------------------------------------------------- accelerate syncs
def accelerate_sync_phase(base: torch.nn.Module, ctx: dict[str, Any]) -> dict[str, Any]:
    """Host syncs in one accelerate step, plain vs guarded vs guarded without a scheduler."""
    device: torch.device = ctx["device"]
    out: dict[str, Any] = {}
    for name, guarded, scheduler in (("plain", False, True), ("guarded", True, True),
                                     ("guarded_no_scheduler", True, False)):
        _fresh_accelerate_state()
        arm = Arm(name, "accelerate", guarded, 1, device)
        step, loader = build_accelerate(arm, copy.deepcopy(base), ctx, scheduler=scheduler)
        batches = itertools.cycle(loader)
        for _ in range(SYNC_WARMUP):  # the guard's steady state: its graphs captured, its reads settled
            step(next(batches))
        counted = [next(batches) for _ in range(SYNC_STEPS)]
        sync(device)
        with warnings.catch_warnings(record=True) as caught, EventSyncCounter() as events:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for batch in counted:
                    step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        messages = [str(w.message) for w in caught  # not the mode's own notice ("... is a prototype feature")
                    if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)]
        out[name] = {"sync_warnings": len(messages) / SYNC_STEPS, "event_synchronize": events.count / SYNC_STEPS,
                     "total": (len(messages) + events.count) / SYNC_STEPS, "steps": SYNC_STEPS,
                     "samples": sorted({m.splitlines()[0][:160] for m in messages})[:5]}
        guard = arm.info.get("guard")
        if guard is not None:
            guard.close()
        del arm, step, loader, batches
        gc.collect()
        torch.cuda.empty_cache()
    out["added_by_guard"] = out["guarded"]["total"] - out["plain"]["total"]
    out["added_by_reading_step_was_skipped"] = out["guarded"]["total"] - out["guarded_no_scheduler"]["total"]
    return out


# ---------------------------------------------------------------------------------------- summary
def _stats(times: list[float]) -> dict[str, Any]:
    t = sorted(times)
    return {"median_ms": 1e3 * statistics.median(t), "p25_ms": 1e3 * t[len(t) // 4],
            "p75_ms": 1e3 * t[(3 * len(t)) // 4], "min_ms": 1e3 * t[0], "max_ms": 1e3 * t[-1], "samples": len(t)}


def summarise(arms: list[Arm], warmup: int) -> dict[str, Any]:
    timing: dict[str, Any] = {}
    timed: dict[str, list[float | None]] = {}
    for arm in arms:
        samples = arm.times[warmup:]
        timed[arm.name] = samples
        ok = [t for t in samples if t is not None]
        timing[arm.name] = _stats(ok) if ok else {"samples": 0}
        if arm.error:
            timing[arm.name]["error"] = arm.error
    ratios: dict[str, Any] = {}
    for fw in FRAMEWORKS:
        plain, guarded = f"{fw}_plain", f"{fw}_guarded"
        if timing.get(plain, {}).get("samples") and timing.get(guarded, {}).get("samples"):
            ratio = timing[guarded]["median_ms"] / timing[plain]["median_ms"]
            paired = sorted(g / p for g, p in zip(timed[guarded], timed[plain]) if g is not None and p is not None)
            med = statistics.median(paired) if paired else None
            target = TARGETS.get(fw, TARGET)
            ratios[fw] = {
                "ratio": ratio,  # of the arms' medians
                "ratio_p25_p75": [timing[guarded]["p25_ms"] / timing[plain]["p25_ms"],  # of the arms' quartiles
                                  timing[guarded]["p75_ms"] / timing[plain]["p75_ms"]],
                # each round's guarded/plain (the same round, side by side): the figure the targets are read on
                "paired_ratio_median": med,
                "paired_ratio_p25_p75": [paired[len(paired) // 4], paired[(3 * len(paired)) // 4]] if paired else None,
                "added_ms_per_step": timing[guarded]["median_ms"] - timing[plain]["median_ms"],
                "target": target,
                "met": med is not None and med <= target,
            }
    return {"timing": timing, "ratios": ratios, "rounds_ms": {
        name: [None if t is None else 1e3 * t for t in samples] for name, samples in timed.items()}}


def print_table(results: dict[str, Any]) -> None:
    timing, ratios = results.get("timing", {}), results.get("ratios", {})
    print(f"\n{'arm':20s} {'median ms':>10s} {'p25':>9s} {'p75':>9s} {'min':>9s} {'max':>9s} {'n':>4s}")
    for name, e in timing.items():
        if not e.get("samples"):
            print(f"{name:20s} {'no samples':>10s}" + ("  ERROR (see JSON)" if e.get("error") else ""))
            continue
        print(f"{name:20s} {e['median_ms']:10.3f} {e['p25_ms']:9.3f} {e['p75_ms']:9.3f} {e['min_ms']:9.3f} "
              f"{e['max_ms']:9.3f} {e['samples']:4d}")
    print(f"\n{'framework':20s} {'paired p25':>10s} {'median':>7s} {'p75':>7s} {'medians':>8s} {'+ms/step':>9s}  "
          "target (paired median)")
    for fw, r in ratios.items():
        med, q = r["paired_ratio_median"], r.get("paired_ratio_p25_p75")
        paired = f"{q[0]:10.4f} {med:7.4f} {q[1]:7.4f}" if med is not None and q else f"{'-':>10s} {'-':>7s} {'-':>7s}"
        print(f"{fw:20s} {paired} {r['ratio']:8.4f} {r['added_ms_per_step']:9.3f}  <= {r['target']}: "
              f"{'met' if r['met'] else 'NOT met'}")
    syncs = results.get("accelerate_syncs")
    if isinstance(syncs, dict) and "error" not in syncs:
        print("\naccelerate host syncs per step (debug-mode warnings + Event.synchronize):")
        for name in ("plain", "guarded", "guarded_no_scheduler"):
            e = syncs[name]
            print(f"  {name:22s} {e['sync_warnings']:5.2f} + {e['event_synchronize']:5.2f} = {e['total']:.2f}")
        print(f"  added by the guard: {syncs['added_by_guard']}; by the scheduler's read of step_was_skipped: "
              f"{syncs['added_by_reading_step_was_skipped']}")
    for name, e in results.get("guards", {}).items():
        print(f"  {name}: {e}")
    for name, e in timing.items():
        if e.get("error"):
            print(f"\n{name} FAILED:\n{e['error']}")


# ---------------------------------------------------------------------------------------- main
def _own_name(name: str) -> str:
    """A profiled callable's own name: pstats names a C method ``<method 'item' of '...' objects>`` and a builtin
    ``<built-in method torch.dot>``; a Python function by its name."""
    if name.startswith("<method '"):
        return name.split("'")[1]
    if name.startswith("<built-in method "):
        return name[len("<built-in method "):].rstrip(">").split(".")[-1]
    return name


def print_profiles(arms: list[Arm], where: str, top: int = 25) -> None:
    """``--pstats``: dump each arm's profile, then per framework the functions on which the guarded arm spends more own
    time a step than the plain one (the largest first), ampguard's functions by cumulative time a step, and the calls
    a step of what can wait for the device (``synchronize``, ``item``, ``query``, ``tolist``, ``cpu``)."""
    import pstats

    os.makedirs(where, exist_ok=True)
    per_step: dict[str, dict[tuple[str, int, str], tuple[float, float, float]]] = {}
    for arm in arms:
        if arm.profile is None:
            continue
        path = os.path.join(where, f"{arm.name}.pstats")
        arm.profile.dump_stats(path)
        n = max(arm.steps, 1)
        stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
        per_step[arm.name] = {k: (v[1] / n, v[2] / n * 1e6, v[3] / n * 1e6) for k, v in stats.items()}
    waiting = ("synchronize", "item", "query", "tolist", "cpu")
    for fw in dict.fromkeys(a.framework for a in arms):
        plain, guarded = per_step.get(f"{fw}_plain"), per_step.get(f"{fw}_guarded")
        if plain is None or guarded is None:
            continue
        diff = sorted(((g[1] - plain.get(k, (0.0, 0.0, 0.0))[1], k, g) for k, g in guarded.items()), reverse=True)
        print(f"\n{fw}: own time a step, guarded minus plain (us), the largest {top}:")
        for extra, (file, line, name), (calls, _own, _cum) in diff[:top]:
            print(f"  {extra:9.1f}  {calls:7.2f} calls  {name} ({os.path.basename(file)}:{line})")
        ours = sorted(((v[2], k, v) for k, v in guarded.items() if "ampguard" in k[0]), reverse=True)
        print(f"{fw}: ampguard's functions by cumulative time a step (us):")
        for cum, (file, line, name), (calls, _own, _c) in ours[:top]:
            print(f"  {cum:9.1f}  {calls:7.2f} calls  {name} ({os.path.relpath(file)}:{line})")
        for arm_name, table in ((f"{fw}_plain", plain), (f"{fw}_guarded", guarded)):
            waits = {name: calls for (_f, _l, name), (calls, _o, _c) in table.items()
                     if _own_name(name) in waiting}
            print(f"{fw}: calls a step that may wait for the device, {arm_name}: "
                  + (", ".join(f"{k} {v:.2f}" for k, v in sorted(waits.items())) or "none"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny GPT-2 and few blocks: a smoke run of the harness")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS[:3]), help="comma list of " + ", ".join(FRAMEWORKS))
    ap.add_argument("--block", type=int, default=None, help="optimizer steps per block (default 10; --quick 3)")
    ap.add_argument("--blocks", type=int, default=None, help="timed rounds (default 50; --quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="rounds discarded first (default 3; --quick 1)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop timing early (keeping the rounds done) when the next round would end past this many "
                         "seconds since start (default 300)")
    ap.add_argument("--no-syncs", action="store_true", help="skip the accelerate sync count (CUDA only anyway)")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="what a block's time is: wall (default), or the arm thread's CPU time over its turn (CLOCK)")
    ap.add_argument("--isolate", action="store_true",
                    help="each arm in its own process (the module docstring): loops that do not move one another's "
                         "memory")
    ap.add_argument("--pstats", default=None,
                    help="run each arm's loop under cProfile, dump <arm>.pstats here and print where each guarded "
                         "arm's host time goes beside its plain arm's, per optimizer step (profiled timings are not "
                         "the figures: take those from a run without it)")
    args = ap.parse_args(argv)
    CLOCK[0] = args.clock
    if args.isolate and args.pstats:
        ap.error("--pstats profiles the arms' threads in this process: not with --isolate")
    t_start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - t_start:6.1f}s]"

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    size = SIZES["tiny" if args.quick else "gpt2"]
    block = args.block or (3 if args.quick else 10)
    blocks = args.blocks or (5 if args.quick else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = set(frameworks) - set(FRAMEWORKS)
    if unknown:
        ap.error(f"unknown framework(s) {sorted(unknown)}; choose from {FRAMEWORKS}")
    rounds = warmup + blocks
    total_steps = (rounds + 2) * block  # the loops never end on their own before the controller stops them
    tmpdir = tempfile.mkdtemp(prefix="ampguard-frameworks-")

    versions: dict[str, str] = {"torch": torch.__version__, "ampguard": ampguard.__version__,
                                "ampguard_from": os.path.dirname(os.path.abspath(ampguard.__file__)),
                                "python": platform.python_version()}
    for pkg in ("accelerate", "transformers", "lightning"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except Exception as exc:
            versions[pkg] = f"unavailable ({type(exc).__name__}: {exc})"
    meta: dict[str, Any] = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "device": torch.cuda.get_device_name(device) if on_cuda else (platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(),
        "model": size,
        "precision": "fp16 (GradScaler on)",
        "block_steps": block, "timed_rounds": blocks, "warmup_rounds": warmup, "budget_s": args.budget_s,
        "frameworks": frameworks,
        "method": ("one process" if args.isolate else "one thread") + " per framework loop, one runs at a time; "
                  "rounds of one block per arm in rotated order; device synchronised at block edges; warm-up rounds "
                  "discarded; median of block time / block",
        "clock": args.clock,
        "isolate": args.isolate, "pid": os.getpid(),
    }
    print(json.dumps({k: meta[k] for k in ("command", "device", "versions")}), flush=True)
    results: dict[str, Any] = {"meta": meta}

    def save() -> None:
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)

    base = build_model(size, device)
    meta["params"] = sum(p.numel() for p in base.parameters())
    print(f"{elapsed()} GPT-2 built: {meta['params'] / 1e6:.1f}M parameters on {device}", flush=True)
    ctx = arms_context(device, size, tmpdir, total_steps)

    if on_cuda and "accelerate" in frameworks and not args.no_syncs:
        try:
            results["accelerate_syncs"] = accelerate_sync_phase(base, ctx)
        except Exception:
            results["accelerate_syncs"] = {"error": traceback.format_exc()[-3000:]}
        print(f"{elapsed()} accelerate sync count done", flush=True)
        save()

    if any(f.startswith(("accelerate", "transformers")) for f in frameworks):
        _fresh_accelerate_state()
    arms: list[Any] = []  # Arm, or IsolatedArm with --isolate
    for fw in frameworks:
        for guarded in (False, True):
            name = f"{fw}_{'guarded' if guarded else 'plain'}"
            if args.isolate:
                arms.append(IsolatedArm(name, fw, guarded, block, device,
                                        {"size": size, "total_steps": total_steps, "clock": args.clock}))
                continue
            arm = Arm(name, fw, guarded, block, device)
            try:
                BUILDERS[fw](arm, copy.deepcopy(base), ctx)
            except Exception:
                arm.error, arm.finished = traceback.format_exc()[-3000:], True
                print(f"{elapsed()} {arm.name}: could not be built:\n{arm.error}", flush=True)
            if args.pstats:
                import cProfile
                arm.profile = cProfile.Profile()
            arms.append(arm)
    for arm in arms:
        if isinstance(arm, IsolatedArm):
            arm.wait_ready()
            if arm.error:
                print(f"{elapsed()} {arm.name}: could not be built:\n{arm.error}", flush=True)
    del base
    gc.collect()
    print(f"{elapsed()} {len(arms)} arms built; {rounds} rounds of {block} steps each", flush=True)

    last_round = 0.0
    for r in range(rounds):
        now = time.perf_counter() - t_start
        if r > warmup and now + last_round > args.budget_s:
            print(f"{elapsed()} time budget reached: stopping after {r - warmup} timed rounds", flush=True)
            meta["stopped_early_after_rounds"] = r - warmup
            break
        t_round = time.perf_counter()
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            t = arm.run_block()
            arm.times.append(None if t is None else t / block)  # seconds per optimizer step
        last_round = time.perf_counter() - t_round
        if r < warmup or (r - warmup) % 10 == 0 or r == rounds - 1:
            done = ", ".join(f"{a.name} {1e3 * a.times[-1]:.1f}" if a.times[-1] is not None else f"{a.name} -"
                             for a in arms)
            print(f"{elapsed()} round {r + 1}/{rounds}{' (warm-up)' if r < warmup else ''}: ms/step {done}",
                  flush=True)
    for arm in arms:
        arm.end()
    print(f"{elapsed()} loops ended", flush=True)

    results.update(summarise(arms, warmup))
    guards: dict[str, Any] = {}
    for arm in arms:
        guards[arm.name] = arm.entry if isinstance(arm, IsolatedArm) else guard_entry(arm)
    results["guards"] = guards
    meta["wall_s"] = time.perf_counter() - t_start
    save()
    print_table(results)
    if args.pstats:
        print_profiles(arms, args.pstats)
    print(f"\n{elapsed()} total", flush=True)
    return 1 if any(a.error for a in arms) else 0


if __name__ == "__main__":
    sys.exit(main())
