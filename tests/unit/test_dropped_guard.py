"""A guard the user drops without ``close()`` (a notebook cell run again, a guard rebuilt after loading a checkpoint, an
exception between ``wrap()`` and the ``try``) is collected, and what it attached to the user's objects goes with it:
the sentinel's hooks on the model, the GradScaler's patched methods, the backend's gradient hooks. (A ``wrap()`` that
raises leaves none of them either: tests/distributed/test_horovod.py, Adasum refused with the sentinel on; the fp8
monitor's part: tests/unit/test_fp8_grad_taps.py.) And a guard never closed still hands its last reports to its
exporters at the interpreter's exit."""

from __future__ import annotations

import copy
import gc
import itertools
import weakref
from pathlib import Path

import torch

import ampguard
from ampguard.shared_scaler import SharedScaler

ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _hooks(model: torch.nn.Module) -> int:
    """Every module and parameter hook on ``model`` (forward, backward, post-accumulate-grad)."""
    n = 0
    for m in model.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        n += len(m._backward_pre_hooks)
    for p in model.parameters():
        n += len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
    return n


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _train(opt, model: torch.nn.Module, steps: range, dtype=torch.bfloat16) -> None:
    for i in steps:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(_batch(i)).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()


def _train_plain(opt, scaler: torch.amp.GradScaler, model: torch.nn.Module, steps: range) -> None:
    """:func:`_train`'s steps in fp16 as torch's plain GradScaler loop takes them (the reference)."""
    for i in steps:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(_batch(i)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_a_dropped_guard_takes_its_sentinel_off_the_model():
    """The sentinel's hooks (one on the root, one per watched block) held the sentinel, not the guard: the guard was
    collected and the hooks stayed, one more set each time a guard was rebuilt on the model, a reduction per block per
    forward for nobody. Fails before stop 51: 4 hooks left."""
    model = _model()
    guard = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16",
                          config={"sentinel": "top"})
    _train(guard, model, range(2))
    assert _hooks(model) == 5  # the root's input and output hooks, the three blocks' output hooks
    alive = weakref.ref(guard)
    del guard
    gc.collect()
    assert alive() is None and _hooks(model) == 0


def test_a_guard_dropped_from_a_shared_scaler_lets_go_of_it():
    """torch's pattern of one GradScaler kept across optimizers: a guard rebuilt on a new optimizer with the same
    scaler, the old guard dropped without close(). Before stop 51 the scaler's patched methods held the old guard (it
    was never collected) and counted it as a second guard sharing the scaler: the new guard's second step was refused
    ("already stepped in this iteration of a GradScaler shared by 2 guards"). Now the old guard is collected and the
    scaler is the new guard's alone: its steps are bitwise torch's plain GradScaler loop, a genuine fp16 overflow
    (init_scale 2**20) and the growth interval included."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    first = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, scaler=scaler,
                          precision="fp16")
    _train(first, model, range(2), torch.float16)
    alive = weakref.ref(first)
    del first
    gc.collect()
    assert alive() is None
    assert SharedScaler.of(scaler) is None and "step" not in scaler.__dict__  # the scaler's own methods again

    plain_model, plain_scaler = copy.deepcopy(model), copy.deepcopy(scaler)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=1e-3)
    guard = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, scaler=scaler,
                          precision="fp16")
    scales = [scaler.get_scale()]
    for i in range(2, 14):
        _train(guard, model, range(i, i + 1), torch.float16)
        _train_plain(plain_opt, plain_scaler, plain_model, range(i, i + 1))
        assert scaler.get_scale() == plain_scaler.get_scale()
        scales.append(scaler.get_scale())
    pairs = list(itertools.pairwise(scales))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # backed off on overflow, grew after 3 clean
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    guard.close()


def test_a_dropped_guard_takes_its_backend_hooks_off_the_model():
    """torch.distributed on a plain module: the backend checks each rank's own gradient before reduction through a
    post-accumulate-grad hook per parameter. They held only the backend's flag: a dropped guard left them, one more
    read of every gradient per backward each time a guard was rebuilt. Fails before stop 51: 4 hooks left."""
    import torch.distributed as dist

    from ampguard.backends.torch_dist import TorchDistBackend

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        guard = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16",
                              backend=TorchDistBackend())
        _train(guard, model, range(2))
        assert _hooks(model) == 4  # one a parameter
        alive = weakref.ref(guard)
        del guard
        gc.collect()
        assert alive() is None and _hooks(model) == 0
    finally:
        dist.destroy_process_group()


_UNCLOSED = """
import sys, torch, ampguard
from ampguard.exporters import JsonlExporter
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                    exporters=[JsonlExporter(sys.argv[1])])
for i in range(21):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
if sys.argv[2] == "close":
    opt.close()
"""


def test_a_run_that_never_closes_its_guard_still_logs_every_step(tmp_path):
    """A script that ends after its loop without ``opt.close()``. Healthy reports wait for a batch before they are
    exported; before stop 51 they were lost at exit: the JSONL log of this 21-step run held steps 0-15. Now the guard
    flushes at exit (no ``close`` event: the run did not end cleanly). With ``close()``: the same steps, one
    ``close`` event, nothing written twice."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for how in ("exit", "close"):
        log = tmp_path / f"{how}.jsonl"
        subprocess.run([sys.executable, "-c", _UNCLOSED, str(log), how], check=True, env=env, timeout=120)
        events = [json.loads(line) for line in log.read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "step"] == list(range(21)), how
        assert [e["event"] for e in events].count("close") == (how == "close")


def test_a_guard_collected_on_another_thread_lets_go_there():
    """weakref.finalize runs on whichever thread's allocation triggers the collection: a data-loader or logging thread
    as often as the training loop's. The guard's hooks, the scaler's patch and its atexit flush go the same way there,
    and the training thread then trains on a rebuilt guard whose steps are bitwise torch's plain GradScaler loop."""
    import threading

    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    guard = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, scaler=scaler,
                          precision="fp16", config={"sentinel": "top"})
    _train(guard, model, range(2), torch.float16)
    alive = weakref.ref(guard)
    holder = [guard]
    del guard
    seen: list[object] = []

    def drop() -> None:  # the last reference goes on this thread, and the collection runs here
        holder.clear()
        gc.collect()
        seen.append(alive())

    gc.disable()  # no collection on this thread in between: the finalizer must run on the other one
    try:
        t = threading.Thread(target=drop)
        t.start()
        t.join()
    finally:
        gc.enable()
    assert seen == [None] and _hooks(model) == 0
    reference, ref_scaler = copy.deepcopy(model), copy.deepcopy(scaler)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-3)
    second = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, scaler=scaler,
                           precision="fp16")
    _train_plain(ref_opt, ref_scaler, reference, range(2, 8))
    _train(second, model, range(2, 8), torch.float16)
    second.close()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert scaler.get_scale() == ref_scaler.get_scale()
