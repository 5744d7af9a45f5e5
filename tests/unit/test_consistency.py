"""ampguard.consistency: the comparison, the majority vote and the second exchange that names the
parameters, on gathered matrices given by a stand-in backend that holds every rank's state (the
multi-rank path runs for real, over gloo, in tests/distributed)."""

from __future__ import annotations

import math

import torch

from ampguard.backends.base import ReadyHandle
from ampguard.backends.torch_dist import Replicas
from ampguard.consistency import FIELDS, check
from ampguard.fingerprint import WORDS, param_fingerprints, params_digest


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


class _Group(_Ranks):
    """A replicate group (HSDP): the digest's words alone, then (second exchange) the fingerprints."""

    def __init__(self, states: list[tuple[float, list[torch.Tensor]]], rank: int) -> None:
        super().__init__(states)
        self.rank = rank

    def all_gather(self, vec: torch.Tensor) -> ReadyHandle:
        if vec.numel() != WORDS:
            return super().all_gather(vec)
        self.calls += 1
        return ReadyHandle(torch.stack([params_digest(params).view(torch.float64) for _, params in self.states]))


class _World:
    """The world-wide gather under HSDP: this rank's vector at its row, the other ranks' ``(step, skipped, scale,
    odd)`` as given."""

    def __init__(self, rank: int, others: dict[int, list[float]]) -> None:
        self.rank, self.others, self.world_size, self.calls = rank, others, len(others) + 1, 0

    def all_gather(self, vec: torch.Tensor) -> ReadyHandle:
        self.calls += 1
        rows = [vec if r == self.rank else torch.tensor(self.others[r], dtype=torch.float64)
                for r in range(self.world_size)]
        return ReadyHandle(torch.stack(rows))


def _hsdp(me: int, group: tuple[int, ...], states: list[tuple[float, list[torch.Tensor]]],
          others: dict[int, list[float]]) -> tuple[object, _World, _Group]:
    """Global rank ``me``, in the replicate group ``group`` (global ranks) whose ranks hold ``states``; both
    parameters replicated."""
    inner = _Group(states, group.index(me))
    world = _World(me, others)
    replicas = Replicas(inner, (0, 1), group)  # type: ignore[arg-type]
    div = check(world, step=5, skipped=1, scale=128.0, params=states[group.index(me)][1],  # type: ignore[arg-type]
                device=torch.device("cpu"), names=["w", "b"], replicas=replicas)
    return div, world, inner


def test_hsdp_agreement_is_none_in_two_gathers() -> None:
    div, world, inner = _hsdp(1, (1, 3), [(128.0, _params()), (128.0, _params())],
                              {r: [5.0, 1.0, 128.0, 0.0] for r in (0, 2, 3)})
    assert div is None and world.calls == 1 and inner.calls == 1


def test_hsdp_the_group_that_differs_names_the_parameter_and_the_global_rank() -> None:
    flipped = _params()
    flipped[0].view(-1).view(torch.int32)[4] ^= 1
    others = {0: [5.0, 1.0, 128.0, 0.0], 2: [5.0, 1.0, 128.0, 0.0], 3: [5.0, 1.0, 128.0, 1.0]}
    div, world, inner = _hsdp(1, (1, 3), [(128.0, _params()), (128.0, flipped)], others)
    assert div is not None and div.ranks == (3,) and div.params == (("w", (3,)),)  # type: ignore[attr-defined]
    assert inner.calls == 2 and world.calls == 1  # the second exchange within the group
    assert "differ in the replicate group of ranks [1, 3] (w on rank(s) [3])" in div.describe()  # type: ignore[attr-defined]


def test_hsdp_another_group_learns_the_odd_rank_and_its_head_fields_still_count() -> None:
    others = {1: [5.0, 1.0, 128.0, 0.0], 2: [5.0, 1.0, 128.0, 0.0], 3: [5.0, 1.0, 128.0, 1.0]}
    div, _, inner = _hsdp(0, (0, 2), [(128.0, _params()), (128.0, _params())], others)
    assert div is not None and div.ranks == (3,) and div.params == () and inner.calls == 1  # type: ignore[attr-defined]
    assert div.fields == ("parameter bits",)  # type: ignore[attr-defined]
    assert "the ranks of the group that differs name the parameters" in div.describe()  # type: ignore[attr-defined]
    # a skipped count that differs world-wide (rank 2) and a flagged rank (3): both named
    others[2] = [5.0, 2.0, 128.0, 0.0]
    div, _, _ = _hsdp(0, (0, 2), [(128.0, _params()), (128.0, _params())], others)
    assert div is not None and div.ranks == (2, 3)  # type: ignore[attr-defined]
    assert div.fields == ("skipped count", "parameter bits")  # type: ignore[attr-defined]


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


def test_the_digest_sees_a_flip_in_a_tensor_it_reads_through_a_copy():
    """The plan is checked by a host-only key (storage address, size, dtype, contiguity) and kept only where its
    views are the tensors' own: a transposed (non-contiguous) tensor or a bool one is read through a copy, which a
    kept plan would go on reading after the tensor changed."""
    from ampguard import fingerprint

    w = torch.randn(64, 48)
    mask = torch.zeros(33, dtype=torch.bool)
    tensors = [w.t(), torch.randn(10), mask]
    first = params_digest(tensors)
    assert id(tensors[0]) not in fingerprint._PLANS
    w.view(torch.int32)[7, 3] ^= 1 << 4  # a bit flipped in the storage the transposed view reads
    second = params_digest(tensors)
    mask[5] = True
    third = params_digest(tensors)
    assert not torch.equal(first, second) and not torch.equal(second, third)
    assert torch.equal(third, params_digest([w.t().contiguous(), tensors[1], mask.clone()]))
