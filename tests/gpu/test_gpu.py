"""On real CUDA hardware: no added host-device syncs, fp16 overflow handling, bitwise identity.

Skipped without CUDA. Run: ``pytest -m gpu tests/gpu -v``.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any
from unittest import mock

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the identity test

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard

# AMPGUARD_GPU_TEST_DEVICE=cpu runs the non-sync tests on the CPU (fp16 autocast): a check of the
# tests themselves, not of the hardware.
DEV = os.environ.get("AMPGUARD_GPU_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_cuda = pytest.mark.skipif(DEV != "cuda", reason="sync debug mode is CUDA's")


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).to(DEV)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 64, generator=g).to(DEV), torch.randint(0, 10, (32,), generator=g).to(DEV)) for _ in range(n)
    ]


def _adamw(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    kw = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **kw)


class _Plain:
    """The loop every user writes today."""

    def __init__(self, fused: bool, clip: float | None = None, init_scale: float = 2.0**16, seed: int = 0):
        self.model = _model(seed)
        self.opt = _adamw(self.model, fused)
        self.scaler = torch.amp.GradScaler(DEV, init_scale=init_scale)
        self.clip = clip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(DEV, dtype=torch.float16):
            loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        if self.clip is not None:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


class _Guarded:
    def __init__(self, fused: bool, clip: float | None = None, init_scale: float = 2.0**16, seed: int = 0,
                 fast: bool = True, **config: object):
        self.model = _model(seed)
        self.scaler = torch.amp.GradScaler(DEV, init_scale=init_scale)
        with mock.patch.dict(os.environ, {"AMPGUARD_FUSED_FAST_PATH": "1" if fast else "0"}):  # read at wrap time
            self.opt = ampguard.wrap(
                _adamw(self.model, fused),
                model=self.model,
                scaler=self.scaler,
                precision="fp16",
                config=ampguard.GuardConfig(clip_grad_norm=clip, **config),  # type: ignore[arg-type]
            )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.opt.autocast():
            loss = F.cross_entropy(self.model(x), y)
        self.opt.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


SYNC_SITES: list[str] = []
"""The Python lines of the synchronising calls :func:`_syncs_of_one_step` counted last ("warn" mode)."""


def _syncs_of_one_step(loop: _Plain | _Guarded, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, bool]:
    """(synchronising calls counted in "warn" mode, whether the step raised in "error" mode)."""
    torch.cuda.synchronize()
    sites: list[str] = []

    def seen(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
        # torch's own sync warning ("called a synchronizing CUDA operation"), not the one-time notice that the first
        # set_sync_debug_mode call of a process gives ("Synchronization debug mode is a prototype feature..."), which
        # this count took for a sync of whichever loop was counted first (stops 38-40's "unexplained" guard sync)
        if "called a synchronizing" in str(message).lower():  # the site, and the project's frames that led there
            frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "ampguard" in f.filename or f.filename == filename]
            sites.append(f"{filename}:{lineno} <- " + " <- ".join(reversed(frames)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loop.step(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    SYNC_SITES[:] = sites  # where the counted syncs were made: for a failing assertion's message
    n = len(sites)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loop.step(*batch)
        raised = False
    except RuntimeError:
        raised = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return n, raised


def assert_no_added_sync(guarded: Any, plain: _Plain, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         graphs: Any, warm: int = 8) -> int:
    """After ``warm`` steps of each loop, the guarded loop's next step synchronises nowhere the plain loop's does
    (``_syncs_of_one_step``, on batch ``warm``); ``graphs``: a ``MeasureGraph`` whose captures and replays the
    failure message reports, with the Python line of every counted sync. Returns the graph's replays before."""
    for b in batches[:warm]:
        guarded.step(*b)
        plain.step(*b)
    before = (graphs.captures, graphs.replays)
    guard_n, guard_raised = _syncs_of_one_step(guarded, batches[warm])
    sites = list(SYNC_SITES)
    plain_n, plain_raised = _syncs_of_one_step(plain, batches[warm])
    assert guard_n <= plain_n and (guard_raised == plain_raised or not guard_raised), (
        f"guarded {guard_n} syncs at {sites}, plain {plain_n}; the graph's (captures, replays) "
        f"{before} -> {(graphs.captures, graphs.replays)}")
    return before[1]


@needs_cuda
@pytest.mark.parametrize("clip", [None, 1.0], ids=["default", "clip"])
def test_fused_guarded_step_adds_no_host_sync(clip: float | None) -> None:
    """Fused AdamW + fp16 GradScaler: a guarded step synchronises nowhere the plain loop doesn't.
    Both are warmed up first (GradScaler's lazy init and the first optimizer step allocate state)."""
    batches = _batches(6)
    plain, guarded = _Plain(fused=True, clip=clip), _Guarded(fused=True, clip=clip)
    for b in batches[:3]:
        plain.step(*b)
        guarded.step(*b)
    plain_n, plain_raised = _syncs_of_one_step(plain, batches[3])
    guard_n, guard_raised = _syncs_of_one_step(guarded, batches[3])
    assert guard_n <= plain_n, f"guarded step made {guard_n} synchronising calls, the plain loop {plain_n}"
    assert guard_raised == plain_raised or not guard_raised, (
        "the guarded step raised under set_sync_debug_mode('error') where the plain loop did not"
    )
    # the lagged report still arrives, and the run stayed healthy
    assert guarded.opt.step_count == 5
    assert guarded.opt.last_report is not None and guarded.opt.last_report.step == 4


@needs_cuda
@pytest.mark.parametrize("policy", ["default", "headroom"])
def test_sampled_numerics_add_no_host_sync(policy: str) -> None:
    """numerics_every=1 (every step sampled: zero counts and headroom on device, the headroom in the
    all-gather, the headroom policy inside the CUDA-graph decision): still no sync the plain fused
    loop does not make, and the sampled values arrive with the lagged report."""
    batches = _batches(8)
    plain = _Plain(fused=True)
    guarded = _Guarded(fused=True, numerics_every=1, scale_policy=policy)
    for b in batches[:4]:  # warm-up; the decision graph is captured on the second step
        plain.step(*b)
        guarded.step(*b)
    plain_n, plain_raised = _syncs_of_one_step(plain, batches[4])
    guard_n, guard_raised = _syncs_of_one_step(guarded, batches[4])
    assert guard_n <= plain_n, f"guarded step made {guard_n} synchronising calls, the plain loop {plain_n}"
    assert guard_raised == plain_raised or not guard_raised
    guarded.opt.flush()
    rep = guarded.opt.last_report
    assert rep is not None and rep.step == 5 and rep.grad_zero_fraction is not None
    assert rep.headroom_log2 is not None and rep.headroom_log2 > 0 and len(rep.group_zero_fractions or ()) == 1


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_sampling_numerics_changes_no_parameter(fused: bool) -> None:
    """With the default scale policy, numerics_every=1 only reads: the same parameters, bit for bit,
    and the same scale as without it, through the first overflows (init_scale 2**24)."""
    batches = _batches(20)
    ref, ref_scale = _run(_Guarded(fused, init_scale=2.0**24), batches)
    sampled = _Guarded(fused, init_scale=2.0**24, numerics_every=1)
    got, got_scale = _run(sampled, batches)
    assert got_scale == ref_scale
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sampled.opt.skipped_steps >= 1 and sampled.opt.history[0].headroom_log2 is not None


@needs_cuda
def test_unfused_guarded_step_syncs_no_more_than_plain() -> None:
    """Unfused AdamW: GradScaler's own found_inf.item() is the one sync; the guard adds none."""
    batches = _batches(5)
    plain, guarded = _Plain(fused=False), _Guarded(fused=False)
    for b in batches[:3]:
        plain.step(*b)
        guarded.step(*b)
    plain_n, _ = _syncs_of_one_step(plain, batches[3])
    guard_n, _ = _syncs_of_one_step(guarded, batches[3])
    assert guard_n <= plain_n, f"guarded step made {guard_n} synchronising calls, the plain loop {plain_n}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_fp16_gradient_overflow_skips_and_backs_off(fused: bool) -> None:
    """A gradient past fp16's 65504 on the device: the step is skipped, the parameters are untouched,
    the scale is halved (GradScaler's backoff), and the next step goes through at the new scale."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).to(DEV)
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**16)
    opt = ampguard.wrap(_adamw(lin, fused), model=lin, scaler=scaler, precision="fp16")
    x = 0.1 * torch.randn(1, 16, device=DEV)  # one row: the bias and weight grads stay under 65504 at 32768
    before = [p.detach().clone() for p in lin.parameters()]
    with opt.autocast():
        out = lin(x)
    assert out.dtype == torch.float16
    # d(loss)/d(out) = 1; scaled by 65536 it is cast back to fp16 in backward: 65536 > 65504 -> inf
    opt.backward(out.float().sum())
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped
    rep = opt.last_report
    assert rep is not None and rep.reason == "nonfinite_grad" and rep.nonfinite_grads >= 1
    assert rep.loss_scale == 2.0**16 and rep.next_loss_scale == 2.0**15
    assert opt.get_scale() == 2.0**15
    assert any(a.kind == "overflow" for a in opt.anomalies)
    for p, b in zip(lin.parameters(), before):
        assert torch.equal(p, b), "a skipped step changed a parameter"
    # at 32768 the same gradient fits in fp16: the step is taken
    with opt.autocast():
        out = lin(x)
    opt.backward(out.float().sum())
    opt.step()
    opt.zero_grad()
    assert not opt.step_was_skipped
    assert opt.get_scale() == 2.0**15
    assert any(not torch.equal(p, b) for p, b in zip(lin.parameters(), before))
    opt.close()


def test_fp16_forward_overflow_is_a_nonfinite_loss() -> None:
    """An activation past 65504 in an fp16 matmul makes the loss inf: skipped as nonfinite_loss."""
    lin = nn.Linear(4, 1, bias=False).to(DEV)
    with torch.no_grad():
        lin.weight.fill_(300.0)
    scaler = torch.amp.GradScaler(DEV, init_scale=2.0**10)
    opt = ampguard.wrap(_adamw(lin, True), model=lin, scaler=scaler, precision="fp16")
    x = torch.full((2, 4), 60.0, device=DEV)  # 4 * 300 * 60 = 72000 > 65504
    before = lin.weight.detach().clone()
    with opt.autocast():
        out = lin(x)
    assert torch.isinf(out).all()
    opt.backward(out.float().mean())
    opt.step()
    opt.zero_grad()
    rep = opt.last_report
    assert rep is not None and rep.skipped and rep.reason == "nonfinite_loss"
    assert torch.equal(lin.weight, before)
    opt.close()


def _run(loop: _Plain | _Guarded, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[torch.Tensor], float]:
    for b in batches:
        loop.step(*b)
    _sync()
    return [p.detach().clone() for p in loop.model.parameters()], float(loop.scaler.get_scale())


@pytest.mark.parametrize(
    ("fused", "clip", "fast"), [(True, None, True), (False, None, True), (True, 1.0, False)],
    ids=["fused", "unfused", "fused-clip-unscale-first"],
)
def test_bitwise_identical_to_plain_gradscaler_loop(fused: bool, clip: float | None, fast: bool) -> None:
    """GuardConfig() (and clip_grad_norm vs unscale_ + clip_grad_norm_) changes nothing numerically
    on CUDA: same parameters, bit for bit, and the same loss scale, over steps that include the
    first fp16 overflows (init_scale 2**24 forces a few). Fused with clipping: bitwise on the
    unscale-first path (``AMPGUARD_FUSED_FAST_PATH=0``); the fast path folds the coefficient into the
    kernel's grad_scale (next test)."""
    batches = _batches(20)
    ref, ref_scale = _run(_Plain(fused, clip, init_scale=2.0**24), batches)
    again, again_scale = _run(_Plain(fused, clip, init_scale=2.0**24), batches)
    if not all(torch.equal(a, b) for a, b in zip(ref, again)) or ref_scale != again_scale:
        pytest.skip("the plain loop itself is not bitwise reproducible on this device")
    guarded = _Guarded(fused, clip, init_scale=2.0**24, fast=fast)
    got, got_scale = _run(guarded, batches)
    assert got_scale == ref_scale
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"parameter {i} differs: max |diff| {(a - b).abs().max().item():.3e}"
    assert guarded.opt.skipped_steps >= 1  # the overflow path was exercised


@pytest.mark.parametrize("clip", [None, 1.0], ids=["default", "clip"])
def test_fused_fast_path_is_taken(clip: float | None, unscale_calls: list[int]) -> None:
    """Fused AdamW + GradScaler: no GradScaler unscale/inf-check kernel runs (the norms of the
    still-scaled gradients give found_inf; the optimizer unscales), and every step measured scaled."""
    guarded = _Guarded(True, clip)
    measure, taken = guarded.opt._pipeline.measure, []

    def spy(guard: object, **kw: bool) -> object:
        m = measure(guard, **kw)
        taken.append(m.scaled)
        return m

    guarded.opt._pipeline.measure = spy  # type: ignore[method-assign]
    _run(guarded, _batches(4))
    assert taken == [True] * 4 and unscale_calls == []
    assert not guarded.opt.step_was_skipped


def test_fused_fast_path_with_clipping_is_close_to_unscale_plus_clip_grad_norm() -> None:
    """The fused fast path with clipping hands the kernel ``grad_scale = scale / clip_coef``: it
    differs from ``unscale_`` + ``clip_grad_norm_`` by float32 rounding of the clipped gradient (a
    few ulp per element; see tests/unit/test_fast_path.py), carried by AdamW over 20 steps (lr 1e-3):
    the same scale sequence and skips, parameters within atol 1e-6 / rtol 1e-5."""
    batches = _batches(20)
    ref, ref_scale = _run(_Plain(True, 1.0, init_scale=2.0**24), batches)
    guarded = _Guarded(True, 1.0, init_scale=2.0**24)
    got, got_scale = _run(guarded, batches)
    assert got_scale == ref_scale
    for i, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"parameter {i}")
    assert guarded.opt.skipped_steps >= 1


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_tensor_norms_are_foreach_norms_bitwise(dtype: torch.dtype) -> None:
    """On CUDA the step's norms are ``_foreach_norm``'s, bitwise (clip_grad_norm_'s kernels), through
    the one-group grouping (passed on the H200, torch 2.11: benchmarks/results/h200_issue16/)."""
    from ampguard.stats import grads_by_device_and_dtype, per_tensor_norms

    g = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for i in range(150):
        p = torch.nn.Parameter(torch.zeros(1 + 37 * i, device="cuda", dtype=dtype))
        p.grad = torch.randn(p.shape, device="cuda", generator=g).to(dtype)
        params.append(p)
    groups = grads_by_device_and_dtype(params)
    got = per_tensor_norms(groups, torch.device("cuda"))
    outs = torch._foreach_norm([p.grad for p in params], 2.0)
    ref = torch.stack(outs).float()
    assert torch.equal(got, ref)
