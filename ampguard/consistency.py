"""Cross-rank consistency check: do all ranks still hold the same training state?

Every ``GuardConfig.consistency_every`` steps the guard gathers, from every rank, its step
count, skipped-step count, loss scale and a cheap fingerprint of the parameters, and compares
them. Ranks that disagree with the majority are reported (ties: the group holding the lowest
rank is taken as the reference, as rank 0 is the usual source of truth for broadcasts).

Cost: one pass over the parameters (two foreach-free reductions per tensor, on device), one
all-gather of ``FIELDS`` float64 values per rank, and one host read of the gathered matrix.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .backends.base import Backend
from .errors import RankDivergenceError
from .records import Anomaly
from .stats import local_tensor
from .vocab import AnomalyKind

if TYPE_CHECKING:
    from .config import GuardConfig
    from .outcome import Outcome
    from .scaling import GradScalerAdapter

__all__ = ["FIELDS", "Divergence", "check", "check_outcome", "fingerprint"]

#: What is compared, in the order of the gathered vector.
FIELDS = ("step count", "skipped count", "loss scale", "parameter sum", "parameter weighted square sum")


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """The result of a failed check."""

    ranks: tuple[int, ...]
    """The odd ranks out (those that differ from the majority)."""
    fields: tuple[str, ...]
    """Names (from :data:`FIELDS`) of the values that differed."""
    values: tuple[tuple[float, ...], ...]
    """Every rank's gathered vector, by rank."""

    def describe(self) -> str:
        parts = []
        for name in self.fields:
            i = FIELDS.index(name)
            per_rank = ", ".join(f"rank {r}: {row[i]!r}" for r, row in enumerate(self.values))
            parts.append(f"{name} ({per_rank})")
        return f"rank(s) {list(self.ranks)} differ from the others in " + "; ".join(parts)


def fingerprint(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Two float64 device scalars: sum of every parameter's elements, and sum over parameters
    of ``(index + 1) * sum(p**2)`` (catches swaps and sign flips the plain sum misses).
    For sharded (DTensor) parameters, this rank's shard. No host sync."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    weighted = torch.zeros((), dtype=torch.float64, device=device)
    for i, p in enumerate(params):
        x = local_tensor(p.detach()).to(dtype=torch.float64)
        total = total + x.sum().to(device)
        weighted = weighted + (i + 1) * x.square().sum().to(device)
    return torch.stack([total, weighted])


def check(
    backend: Backend,
    *,
    step: int,
    skipped: int,
    scale: torch.Tensor | float,
    params: Iterable[torch.Tensor],
    device: torch.device,
    compare_params: bool = True,
) -> Divergence | None:
    """Gather the state of every rank and compare it. Returns None when every rank agrees.

    collective: every rank must call it, at the same step. Synchronises the host (reads the
    gathered values). ``compare_params=False`` leaves the fingerprint out (sharded parameters,
    where every rank legitimately holds different values).
    """
    scale_t = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    head = torch.tensor([float(step), float(skipped)], dtype=torch.float64, device=device)
    vec = torch.cat(
        [head, scale_t.detach().reshape(1).to(device=device, dtype=torch.float64), fingerprint(params, device)]
    )
    gathered = backend.all_gather(vec).wait()
    rows = [tuple(float(v) for v in row) for row in gathered.cpu().tolist()]
    n = len(FIELDS) if compare_params else 3
    keys = [tuple(v if v == v else "nan" for v in row[:n]) for row in rows]  # NaN == NaN here
    if len(set(keys)) <= 1:
        return None
    counts = Counter(keys)
    best = max(counts.values())
    # majority; on a tie, the group that holds the lowest rank is the reference
    reference = next(k for k in keys if counts[k] == best)
    odd = tuple(r for r, k in enumerate(keys) if k != reference)
    differing = tuple(FIELDS[i] for i in range(n) if len({k[i] for k in keys}) > 1)
    return Divergence(ranks=odd, fields=differing, values=tuple(rows))


def check_outcome(outcome: Outcome, step: int, scale: GradScalerAdapter | None, params: Iterable[torch.Tensor],
                  device: torch.device, config: GuardConfig) -> None:
    """Run :func:`check` after a guard's step (``step``: steps so far): a mismatch becomes a
    ``rank_divergence`` anomaly on the step just taken, in ``outcome``'s records, and raises per
    ``config.on_divergence``. collective; synchronises the host."""
    rep, backend = outcome.records, outcome.backend
    div = check(backend, step=step, skipped=rep.skipped_total, scale=scale.scale if scale else 1.0,
                params=params, device=device, compare_params=not backend.grads_sharded)
    if div is None:
        return
    rep.divergence = Anomaly(step - 1, AnomalyKind.RANK_DIVERGENCE, div.describe(), div.ranks)
    if config.on_divergence == "raise":
        rep.decode()
        raise RankDivergenceError(f"step {step - 1}: {div.describe()}", div.ranks)
