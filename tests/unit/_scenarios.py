"""Real causes of non-finite training steps, as tiny CPU runs: what ampguard names for each.

Each scenario builds a model, an optimizer and a data stream in which the cause occurs as it
does in real runs (a batch, a learning rate, a weight, fp16's range), on the rank ``culprit``
only when there are several. :func:`run` trains it through ``ampguard.wrap`` (fp16 autocast on
CPU with ``torch.amp.GradScaler("cpu")``, or bf16) and returns what the guard recorded. Shared
by ``tests/unit/test_diagnosis_scenarios.py`` (one process) and
``tests/distributed/test_diagnosis_distributed.py`` (the same scenarios on one rank of two).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard
from ampguard import faults

D, CLASSES, BATCH, SEQ = 16, 4, 8, 6


class Attention(nn.Module):
    """Self-attention without the 1/sqrt(d) scaling, q and k initialised at std 1 (not 0.02):
    its logits grow with |x|², and fp16 ends at 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))
        for lin in (self.q, self.k):
            nn.init.normal_(lin.weight, std=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        weights = (q @ k.transpose(-2, -1)).softmax(-1)  # fp16: logits past 65504 -> inf -> NaN
        return self.proj(weights @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).mean(1)


class Log(nn.Module):
    """Log-transform of a feature that should be positive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Adapted(nn.Module):
    """A frozen linear layer with a low-rank adapter (LoRA-style) added to it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        self.adapter = nn.Sequential(nn.Linear(D, 4, bias=False), nn.Linear(4, D, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter(x)


def mlp(*front: nn.Module) -> nn.Module:
    return nn.Sequential(*front, nn.Linear(8, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, CLASSES))


@dataclasses.dataclass
class Scenario:
    """How one cause arises. ``bad(step, rank, x)`` returns the batch as the cause leaves it."""

    name: str
    model: Callable[[], nn.Module]
    steps: int = 6
    precision: str = "fp16"
    bad: Callable[[int, bool, torch.Tensor], torch.Tensor] = lambda step, culprit, x: x
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)
    schedule: Callable[[int], float] | None = None
    """LR multiplier of step t (a LambdaLR on the inner optimizer)."""
    faults: Callable[[int], list[faults.Fault]] = lambda culprit: []
    seq: bool = False
    """Batches of sequences (B, T, 8) instead of rows (B, 8)."""
    init_scale: float = 2.0 ** 8
    """fp16: the GradScaler's initial loss scale."""


BAD_STEPS = (3, 4)
"""Steps whose batch carries the cause in the data-born scenarios (two in a row, as a bad shard)."""


def _at_bad(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int, bool, torch.Tensor], torch.Tensor]:
    return lambda step, culprit, x: fn(x) if culprit and step in BAD_STEPS else x


def _poke(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[0, 0] = value
        return x

    return fn


def _constant_row(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0] = 1.0  # a padding row: every feature the same
    return x


def _loud(factor: float) -> Callable[[int, bool, torch.Tensor], torch.Tensor]:
    """The culprit rank's data, ``factor`` times larger in every step (an unnormalised shard)."""
    return lambda step, culprit, x: x * factor if culprit else x


def _adapter_opt(model: nn.Module) -> torch.optim.Optimizer:
    for name, p in model.named_parameters():
        p.requires_grad_(".adapter." in f".{name}")
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapter = [p for p in model.parameters() if p.requires_grad]
    # The frozen layers stay in the optimizer (as many fine-tuning scripts leave them); the
    # adapter's group has a learning rate meant for a schedule that was never attached.
    return torch.optim.AdamW([{"params": frozen}, {"params": adapter, "lr": 50.0}], lr=1e-3)


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)  # the same initial parameters on every rank
        return build()

    return make


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("attention_overflow", _seeded(AttnNet), seq=True, bad=_at_bad(lambda x: x * 64.0)),
    Scenario("log_negative", _seeded(lambda: mlp(Log())), bad=_at_bad(_poke(-1.0))),
    Scenario("layernorm_constant_row", _seeded(lambda: mlp(nn.LayerNorm(8, eps=0.0))), bad=_at_bad(_constant_row)),
    Scenario("input_inf", _seeded(lambda: mlp()), bad=_at_bad(_poke(math.inf))),
    # A warm-up that multiplies the learning rate by 3 every step (a schedule in the wrong direction).
    Scenario("lr_explosion", _seeded(lambda: mlp()), steps=18, schedule=lambda t: 3.0 ** t, init_scale=1.0,
             optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), bad=_loud(16.0)),
    Scenario("frozen_bad_adapter", _seeded(lambda: nn.Sequential(nn.Linear(8, D), nn.ReLU(), Adapted(), nn.ReLU(),
                                                                 nn.Linear(D, CLASSES))),
             steps=10, optimizer=_adapter_opt, bad=_loud(8.0)),
    Scenario("glitch", _seeded(AttnNet), seq=True, precision="bf16",
             faults=lambda culprit: [faults.output("blocks.1.mlp", "nan", steps=[2, 4], ranks=[culprit],
                                                   transient=True)]),
    Scenario("persistent_fault", _seeded(AttnNet), seq=True, precision="bf16",
             faults=lambda culprit: [faults.output("blocks.1.mlp", "nan", steps=[3], ranks=[culprit])]),
]}


def batch(step: int, rank: int, seq: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank
    shape = (BATCH, SEQ, 8) if seq else (BATCH, 8)
    return torch.rand(shape, generator=g) + 0.5, torch.randint(0, CLASSES, (BATCH,), generator=g)


def run(name: str, *, closure: bool, rank: int = 0, world: int = 1, culprit: int = 0,
        wrap_model: Callable[[nn.Module], nn.Module] = lambda m: m, config: dict[str, Any] | None = None,
        device: str = "cpu") -> dict[str, Any]:
    """Train scenario ``name``; the cause occurs on rank ``culprit``. Returns the anomalies (as
    tuples: step, kind, module, phase, cause, params, ranks, detail), the quarantine, the skipped
    steps and the parameter names. ``device``: where the model and batches live ("cuda" on the GPU
    machine: ``tests/gpu/test_gpu_diagnosis.py``)."""
    s = SCENARIOS[name]
    base = s.model().to(device)
    inner = s.optimizer(base)
    model = wrap_model(base)
    scaler = torch.amp.GradScaler(device, init_scale=s.init_scale) if s.precision == "fp16" else None
    opt = ampguard.wrap(inner, model=model, precision=s.precision, scaler=scaler, config=config)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, s.schedule) if s.schedule is not None else None
    faults.inject(opt, *s.faults(culprit))
    for step in range(s.steps):
        x, y = batch(step, rank, s.seq)
        x = s.bad(step, rank == culprit, x)
        x, y = x.to(device), y.to(device)

        def compute(x: torch.Tensor = x, y: torch.Tensor = y, step: int = step) -> None:
            opt.zero_grad()
            with opt.autocast():
                logits = model(x)
            opt.backward(F.cross_entropy(logits.float(), y), batch_id=(rank, step))

        if closure:
            opt.step(compute, replay=True)
        else:
            compute()
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    opt.close()
    return {
        "anomalies": [(a.step, str(a.kind), a.module, a.phase and str(a.phase), a.cause and str(a.cause), a.params,
                       a.ranks, a.detail) for a in opt.anomalies],
        "quarantine": list(opt.quarantine),
        "skipped": [r.step for r in opt.history if r.skipped],
        "param_names": opt.param_names,
    }


def named(result: dict[str, Any]) -> dict[int, tuple[Any, ...]]:
    """Step -> (module, phase, cause, first parameter, ranks) of the anomalies forensics annotated."""
    return {a[0]: (a[2], a[3], a[4], a[5][0] if a[5] else None, a[6]) for a in result["anomalies"]
            if a[4] is not None}
