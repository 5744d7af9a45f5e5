"""Tiny models and loops shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import ampguard


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def hook_count(model: torch.nn.Module) -> int:
    """Forward and forward-pre hooks registered on ``model``'s modules (forensics' armed hooks among them)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def make_data(n: int = 12, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def make_opt(model: torch.nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    raise ValueError(kind)


NON_FUSED = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),  # the for-loop implementation
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}
"""The non-fused optimizers the unscaling paths are held to the plain loop with (norms first on the CPU, the tensor
decision off it), by name."""


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def guarded_steps(opt: ampguard.GuardedOptimizer, model: torch.nn.Module, data) -> None:
    for x, y in data:
        with opt.autocast():
            loss = loss_of(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def step_once(opt: ampguard.GuardedOptimizer, run, *, closure: bool) -> None:
    """One guarded step of ``run`` (zero_grad, forward, ``opt.backward``): handed to ``step()``
    as a replay closure (``closure=True``), or run first and then ``step()``; then zero_grad."""
    if closure:
        opt.step(run, replay=True)
    else:
        run()
        opt.step()
    opt.zero_grad()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"s.{i}.{k}"] = v.detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def one_step(guarded: bool, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, loss: torch.Tensor) -> None:
    """The guarded step, or torch's ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``."""
    if guarded:
        opt.backward(loss)  # type: ignore[attr-defined]
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def hf_steps(opt: ampguard.GuardedOptimizer, model: torch.nn.Module, steps: int,
             before: Callable[[int], object] | None = None) -> None:
    """``steps`` guarded steps of a Hugging Face language model (``benchmarks/hf_classification.py``'s families) on
    random token batches, the same every run, its own labels; ``before(step)`` first, each step."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if before is not None:
            before(step)
        ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
