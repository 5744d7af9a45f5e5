"""ampguard.consistency: the comparison, the majority vote and the second exchange that names the
parameters, on gathered matrices given by a stand-in backend that holds every rank's state (the
multi-rank path runs for real, over gloo, in tests/distributed)."""

from __future__ import annotations

import math

import torch

from ampguard.backends.base import ReadyHandle
from ampguard.consistency import FIELDS, check
from ampguard.fingerprint import param_fingerprints, params_digest


class _Ranks:
    """A backend whose all_gather stacks every rank's vector, each made from that rank's state."""

    def __init__(self, states: list[tuple[float, list[torch.Tensor]]]) -> None:
        self.states, self.world_size, self.calls = states, len(states), 0

    def all_gather(self, vec: torch.Tensor) -> ReadyHandle:
        self.calls += 1
        rows = []
        for scale, params in self.states:
            fps = param_fingerprints(params)
            if vec.numel() == len(FIELDS):
                rows.append(torch.cat([torch.tensor([5.0, 1.0, scale], dtype=torch.float64),
                                       params_digest(params).view(torch.float64)]))
            else:
                rows.append(fps.view(torch.float64).reshape(-1))
        return ReadyHandle(torch.stack(rows))


def _run(states: list[tuple[float, list[torch.Tensor]]], me: int = 0, **kw: object) -> object:
    scale, params = states[me]
    return check(_Ranks(states), step=5, skipped=1, scale=torch.tensor(scale), params=params,  # type: ignore[arg-type]
                 device=torch.device("cpu"), names=["w", "b"], **kw)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 3, generator=g), torch.randn(3, generator=g)]


def test_agreement_is_none() -> None:
    assert _run([(128.0, _params()), (128.0, _params()), (128.0, _params())]) is None


def test_majority_names_the_odd_rank_and_the_field() -> None:
    div = _run([(128.0, _params()), (128.0, _params()), (64.0, _params())])
    assert div is not None and div.ranks == (2,) and div.fields == ("loss scale",)
    assert "rank(s) [2]" in div.describe() and "loss scale" in div.describe()


def test_one_flipped_bit_names_the_rank_and_the_parameter() -> None:
    flipped = _params()
    flipped[1].view(torch.int32)[2] ^= 1  # the last mantissa bit of one element: 1 ulp
    backend = _Ranks([(128.0, _params()), (128.0, flipped), (128.0, _params())])
    div = check(backend, step=5, skipped=1, scale=torch.tensor(128.0), params=_params(),  # type: ignore[arg-type]
                device=torch.device("cpu"), names=["w", "b"])
    assert div is not None and div.ranks == (1,) and div.params == (("b", (1,)),)
    assert backend.calls == 2  # the second exchange runs only on a mismatch
    assert "b on rank(s) [1]" in div.describe()


def test_the_second_exchange_runs_only_on_a_mismatch() -> None:
    backend = _Ranks([(128.0, _params()), (128.0, _params())])
    assert check(backend, step=5, skipped=1, scale=128.0, params=_params(),  # type: ignore[arg-type]
                 device=torch.device("cpu")) is None
    assert backend.calls == 1


def test_tie_keeps_the_lowest_rank_as_reference() -> None:
    div = _run([(128.0, _params()), (128.0, [p + 1 for p in _params()])])
    assert div is not None and div.ranks == (1,)
    assert set(div.fields) <= set(FIELDS[3:]) and div.fields
    assert {name for name, _ in div.params} == {"w", "b"}


def test_sharded_parameters_are_left_out() -> None:
    assert _run([(128.0, _params()), (128.0, [p + 1 for p in _params()])], compare_params=False) is None


def test_the_same_nan_bits_agree_and_other_nan_bits_do_not() -> None:
    nan = [torch.full((2,), math.nan), torch.zeros(1)]
    assert _run([(128.0, nan), (128.0, [t.clone() for t in nan])]) is None
    other = [t.clone() for t in nan]
    other[0].view(torch.int32)[0] ^= 1  # another NaN payload: bitwise different
    assert _run([(128.0, nan), (128.0, other)]) is not None


def test_fingerprint_sees_swapped_parameters() -> None:
    a, b = torch.randn(4), torch.randn(4)
    assert not torch.equal(params_digest([a, b]), params_digest([b, a]))


def test_the_digest_plan_is_reused_sees_every_change_and_goes_with_its_model():
    import gc
    import weakref

    from ampguard import fingerprint

    model = torch.nn.Sequential(torch.nn.Linear(70, 90), torch.nn.Linear(90, 3)).to(torch.bfloat16)
    params = list(model.parameters())
    first = params_digest(params)
    plan = fingerprint._PLANS[id(params[0])]
    with torch.no_grad():  # an optimizer's in-place update: the same storage, the plan reused, the change seen
        params[1].view(torch.int16)[5] ^= 1
    second = params_digest(params)
    assert fingerprint._PLANS[id(params[0])] is plan and not torch.equal(first, second)
    # a bitwise fold of the per-parameter sums (laid end to end) gives the same plain sum
    assert second[0] == param_fingerprints(params)[:, 0].sum()
    model[0].bias = torch.nn.Parameter(params[1].detach().clone())  # replaced storage: a new plan, same digest
    assert torch.equal(params_digest(list(model.parameters())), second)
    alive = weakref.ref(params[0])
    key = id(params[0])
    del model, params, plan
    gc.collect()
    assert alive() is None and key not in fingerprint._PLANS  # the plan did not keep the model alive
