"""ampguard.consistency: the comparison and the majority vote, on gathered matrices given by a
stand-in Collective (the multi-rank path is tested for real in tests/distributed)."""

from __future__ import annotations

import math

import torch

from ampguard.backends.base import ReadyHandle
from ampguard.consistency import FIELDS, check, fingerprint


class _Gathered:
    """A Collective whose all_gather returns this rank's vector with other ranks' rows."""

    def __init__(self, others: dict[int, list[float]], world: int) -> None:
        self.others, self.world_size = others, world

    def all_gather(self, vec: torch.Tensor) -> ReadyHandle:
        rows = [
            torch.tensor(self.others[r], dtype=vec.dtype) if r in self.others else vec for r in range(self.world_size)
        ]
        return ReadyHandle(torch.stack(rows))


def _mine(params: list[torch.Tensor]) -> list[float]:
    return [5.0, 1.0, 128.0, *fingerprint(params, torch.device("cpu")).tolist()]


def _run(others: dict[int, list[float]], world: int, params: list[torch.Tensor], **kw: object) -> object:
    return check(_Gathered(others, world), step=5, skipped=1, scale=torch.tensor(128.0), params=params,
                 device=torch.device("cpu"), **kw)  # type: ignore[arg-type]


def test_agreement_is_none() -> None:
    params = [torch.randn(3, 3), torch.randn(3)]
    assert _run({1: _mine(params), 2: _mine(params)}, 3, params) is None


def test_majority_names_the_odd_rank_and_the_field() -> None:
    params = [torch.randn(3, 3), torch.randn(3)]
    odd = _mine(params)
    odd[2] = 64.0  # another loss scale on rank 2
    div = _run({1: _mine(params), 2: odd}, 3, params)
    assert div is not None and div.ranks == (2,) and div.fields == ("loss scale",)
    assert "rank(s) [2]" in div.describe() and "loss scale" in div.describe()


def test_tie_keeps_the_lowest_rank_as_reference() -> None:
    params = [torch.randn(4)]
    other = _mine([params[0] + 1])
    div = _run({1: other}, 2, params)
    assert div is not None and div.ranks == (1,)
    assert set(div.fields) <= set(FIELDS[3:]) and div.fields


def test_sharded_parameters_are_left_out() -> None:
    params = [torch.randn(4)]
    assert _run({1: _mine([params[0] + 1])}, 2, params, compare_params=False) is None


def test_nan_equals_nan() -> None:
    params = [torch.full((2,), math.nan)]
    assert _run({1: _mine(params)}, 2, params) is None


def test_fingerprint_sees_swapped_parameters() -> None:
    a, b = torch.randn(4), torch.randn(4)
    assert not torch.equal(fingerprint([a, b], torch.device("cpu")), fingerprint([b, a], torch.device("cpu")))
