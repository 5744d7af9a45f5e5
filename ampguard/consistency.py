"""Cross-rank consistency check: do all ranks still hold the same training state?

Every ``GuardConfig.consistency_every`` steps the guard gathers, from every rank, its step count,
skipped-step count, loss scale and a bitwise digest of its parameters
(:func:`ampguard.fingerprint.params_digest`: their bits summed in int64, in chunks), and compares
them. Ranks that disagree with the majority are reported (ties: the group holding the lowest rank
is taken as the reference, as rank 0 is the usual source of truth for broadcasts). Only when the
digests differ, a second exchange of every parameter's fingerprint names the parameters that
differ and, for each, the ranks holding other bits.

The digest is exact (integer sums of the parameters' bits: any flipped bit shows, and the same
bits give the same words on every device), so replicas that agree agree bitwise. Its int64 words
travel through the float64 all-gather as raw bits (``Tensor.view``), never as values.

HSDP (FSDP2 on a ``("replicate", "shard")`` mesh; ``replicas=``, from the backend's optional
``replicas(params)``): the ranks of one replicate group hold the same shard, so the digest of the
replicated parameters' local shards is gathered and compared within that group (and, on a mismatch,
the second exchange runs there and names the parameters); then one world-wide all-gather carries
every rank's step count, skipped count, loss scale and whether its group found it odd, so every rank
takes the same finding (the same odd ranks; the ranks of the group that differs also name the
parameters).

Cost: one read of the parameters on device (an int64 temporary of the largest tensor), one
all-gather of ``len(FIELDS)`` float64 words per rank, one host read of the gathered matrix; on a
mismatch only, one more all-gather of two int64 words per parameter. HSDP: the digest's two words
are gathered over the replicate group (the second exchange too), and the world-wide all-gather
carries four float64 words per rank (step, skipped, scale, odd): one more all-gather, and a second
host read, per checked step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .backends.base import Backend
from .errors import RankDivergenceError
from .fingerprint import WORDS, param_fingerprints, params_digest
from .records import Anomaly
from .vocab import AnomalyKind

if TYPE_CHECKING:
    from .backends.torch_dist import Replicas
    from .config import GuardConfig
    from .outcome import Outcome
    from .scaling import GradScalerAdapter

__all__ = ["FIELDS", "Divergence", "check", "check_outcome"]

#: What is compared, in the order of the gathered vector (the last two: the parameters' digest words,
#: :func:`ampguard.fingerprint.params_digest`; zeros where the parameters are not compared).
FIELDS = ("step count", "skipped count", "loss scale", "parameter bits", "parameter weighted bits")
_HEAD = 3
_DIGEST = len(FIELDS) - _HEAD


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """The result of a failed check."""

    ranks: tuple[int, ...]
    """The odd ranks out (those that differ from the majority)."""
    fields: tuple[str, ...]
    """Names (from :data:`FIELDS`) of the values that differed."""
    values: tuple[tuple[float | int, ...], ...]
    """Every rank's gathered vector, by rank (the digest words as ints; HSDP: step, skipped, scale, and 1.0 where
    its replicate group found its parameter bits odd)."""
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Each parameter whose bits differ across ranks, with the ranks that hold other bits than the
    majority (found by the second exchange; empty where the parameters agree, and, under HSDP, on the ranks of a
    replicate group whose replicas agree)."""
    group: tuple[int, ...] = ()
    """HSDP: the global ranks of the replicate group the parameters were compared in (this rank's group, which
    is the one that differs where :attr:`params` names any); empty where they were compared across every rank."""

    def describe(self) -> str:
        parts = []
        for name in self.fields:
            i = FIELDS.index(name)
            if i >= _HEAD:
                continue
            per_rank = ", ".join(f"rank {r}: {row[i]!r}" for r, row in enumerate(self.values))
            parts.append(f"{name} ({per_rank})")
        if self.params:
            shown = "; ".join(f"{name} on rank(s) {list(ranks)}" for name, ranks in self.params[:5])
            more = f" and {len(self.params) - 5} more" if len(self.params) > 5 else ""
            within = f" in the replicate group of ranks {list(self.group)}" if self.group else ""
            parts.append(f"parameter bits: {len(self.params)} parameter(s) differ{within} ({shown}{more})")
        elif any(FIELDS.index(n) >= _HEAD for n in self.fields):
            parts.append("parameter bits (compared within each replicate group: the ranks of the group that differs "
                         "name the parameters)" if self.group else "parameter bits (the digests differ)")
        return f"rank(s) {list(self.ranks)} differ from the others in " + "; ".join(parts)


def _key(values: Sequence[float | int]) -> tuple[object, ...]:
    """A rank's gathered values as a comparable key: NaN == NaN here (a NaN scale on every rank agrees)."""
    return tuple(v if v == v else "nan" for v in values)


def _odd_ones_out(keys: Sequence[object]) -> tuple[int, ...]:
    """The ranks whose key differs from the majority's (a tie: the group holding the lowest rank)."""
    counts = Counter(keys)
    best = max(counts.values())
    reference = next(k for k in keys if counts[k] == best)
    return tuple(r for r, k in enumerate(keys) if k != reference)


def check(
    backend: Backend,
    *,
    step: int,
    skipped: int,
    scale: torch.Tensor | float,
    params: Sequence[torch.Tensor],
    device: torch.device,
    compare_params: bool = True,
    names: Sequence[str] = (),
    replicas: Replicas | None = None,
) -> Divergence | None:
    """Gather the state of every rank and compare it. Returns None when every rank agrees.

    collective: every rank must call it, at the same step (and, on a parameter mismatch, the second
    exchange runs on every rank too: every rank sees the same gathered digests). Synchronises the
    host (reads the gathered values). ``compare_params=False`` leaves the parameters out (sharded
    parameters, where every rank legitimately holds different values). ``names``: the parameters'
    names, for the second exchange's finding (default ``param{i}``).

    ``replicas`` (HSDP: :meth:`ampguard.backends.torch_dist.TorchDistBackend.replicas`): the parameters
    ``params[i]`` for ``i`` in ``replicas.members`` are compared within ``replicas.backend``'s group (every rank
    of it holds the same shard), the rest of the fields across ``backend``; the result is the same on every rank
    but for :attr:`Divergence.params`, named by the ranks of the replicate group that differs. Ranks are those of
    ``backend`` (the world, as ``wrap()`` builds it), parameters' ranks ``replicas.ranks`` (global).
    """
    scale_t = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    head = torch.cat([torch.tensor([float(step), float(skipped)], dtype=torch.float64, device=device),
                      scale_t.detach().reshape(1).to(device=device, dtype=torch.float64)])
    if replicas is not None and compare_params and replicas.members:
        return _check_replicated(backend, replicas, head, params, device, names)
    compared = compare_params and len(params) > 0
    words = params_digest(list(params)).to(device) if compared else torch.zeros(0, dtype=torch.int64, device=device)
    words = words if compared else torch.zeros(_DIGEST, dtype=torch.int64, device=device)
    vec = torch.cat([head, words.view(torch.float64)])  # the int64 words as raw bits: exact through the gather
    gathered = backend.all_gather(vec).wait().cpu()
    heads = gathered[:, :_HEAD].tolist()
    digests = gathered[:, _HEAD:].contiguous().view(torch.int64).tolist()
    rows = [tuple(h) + tuple(d) for h, d in zip(heads, digests)]
    n = len(FIELDS) if compare_params else _HEAD
    keys = [_key(row[:n]) for row in rows]
    if len(set(keys)) <= 1:
        return None
    odd = _odd_ones_out(keys)
    differing = tuple(FIELDS[i] for i in range(n) if len({k[i] for k in keys}) > 1)
    found: tuple[tuple[str, tuple[int, ...]], ...] = ()
    if compared and any(FIELDS.index(f) >= _HEAD for f in differing):  # only now: a fingerprint per parameter
        found = _which_params(backend, param_fingerprints(list(params)).to(device), names)
    return Divergence(ranks=odd, fields=differing, values=tuple(rows), params=found)


def _check_replicated(backend: Backend, replicas: Replicas, head: torch.Tensor, params: Sequence[torch.Tensor],
                      device: torch.device, names: Sequence[str]) -> Divergence | None:
    """:func:`check` under HSDP: the replicated parameters' digest within the replicate group, then one
    world-wide all-gather of ``head`` (step, skipped, scale) and whether this rank is odd, so every rank finds the
    same odd ranks. collective (the second exchange: on the ranks of a group whose digests differ only)."""
    members = replicas.members
    local = [params[i] for i in members]
    local_names = [names[i] if i < len(names) else f"param{i}" for i in members]
    words = params_digest(local).to(device).view(torch.float64)  # raw bits, as in check()
    digests = replicas.backend.all_gather(words).wait().cpu().contiguous().view(torch.int64).tolist()
    keys = [tuple(d) for d in digests]
    odd: tuple[int, ...] = ()
    found: tuple[tuple[str, tuple[int, ...]], ...] = ()
    if len(set(keys)) > 1:  # this group's replicas differ: name the parameters, in this group
        odd = _odd_ones_out(keys)
        found = tuple((name, tuple(replicas.ranks[r] for r in rs)) for name, rs in
                      _which_params(replicas.backend, param_fingerprints(local).to(device), local_names))
    mine = torch.tensor([1.0 if replicas.backend.rank in odd else 0.0], dtype=torch.float64, device=device)
    vec = torch.cat([head, mine])
    gathered = backend.all_gather(vec).wait().cpu().tolist()  # every rank: its head, and whether it is odd
    keys_head = [_key(row[:_HEAD]) for row in gathered]
    flagged = {r for r, row in enumerate(gathered) if row[_HEAD] != 0.0}
    if len(set(keys_head)) <= 1 and not flagged:
        return None
    differing = tuple(FIELDS[i] for i in range(_HEAD) if len({k[i] for k in keys_head}) > 1)
    if flagged:
        differing += (FIELDS[_HEAD],)
    ranks = set(_odd_ones_out(keys_head)) if len(set(keys_head)) > 1 else set()
    return Divergence(ranks=tuple(sorted(ranks | flagged)), fields=differing,
                      values=tuple(tuple(row) for row in gathered), params=found, group=replicas.ranks)


def _which_params(backend: Backend, fps: torch.Tensor, names: Sequence[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The second exchange: every rank's per-parameter fingerprints; each parameter whose rows differ,
    with the ranks that hold other bits than the majority. collective."""
    every = backend.all_gather(fps.contiguous().view(torch.float64).reshape(-1)).wait().cpu()
    per_rank = every.contiguous().view(torch.int64).reshape(every.shape[0], -1, WORDS).tolist()
    out = []
    for i in range(len(per_rank[0])):
        keys = [tuple(rank[i]) for rank in per_rank]
        if len(set(keys)) > 1:
            out.append((names[i] if i < len(names) else f"param{i}", _odd_ones_out(keys)))
    return tuple(out)


def check_outcome(outcome: Outcome, step: int, scale: GradScalerAdapter | None, params: Sequence[torch.Tensor],
                  device: torch.device, config: GuardConfig) -> None:
    """Run :func:`check` after a guard's step (``step``: steps so far): a mismatch becomes a
    ``rank_divergence`` anomaly on the step just taken, in ``outcome``'s records (naming the
    parameters whose bits differ), and raises per ``config.on_divergence``. collective; synchronises
    the host. Sharded parameters (FSDP) are compared only where the backend's optional ``replicas(params)``
    finds replicated ones (HSDP: within each replicate group)."""
    rep, backend = outcome.records, outcome.backend
    find = getattr(backend, "replicas", None) if backend.grads_sharded else None  # optional: HSDP's replicate groups
    replicas = find(params) if find is not None else None
    div = check(backend, step=step, skipped=rep.skipped_total, scale=scale.scale if scale else 1.0,
                params=params, device=device, compare_params=not backend.grads_sharded or replicas is not None,
                names=rep.names(), replicas=replicas)
    if div is None:
        return
    rep.divergence = Anomaly(step - 1, AnomalyKind.RANK_DIVERGENCE, div.describe(), div.ranks,
                             tuple(name for name, _ in div.params[:8]))
    if config.on_divergence == "raise":
        rep.decode()
        raise RankDivergenceError(f"step {step - 1}: {div.describe()}", div.ranks)
