"""``MeasureGraph``'s bookkeeping (which key is captured, replayed, evicted; the fallback when a capture fails), on the
CPU with a stand-in for the CUDA capture: the stand-in records the function and re-runs it on replay into the same
output tensors, as a graph writes its static outputs. The CUDA behaviour itself (the same values as the eager
stages, gradients at new addresses read where they are) is tests/gpu/test_gpu_measure_graph.py's."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ampguard import decision_graph
from ampguard.decision_graph import MeasureGraph


class _Graph:
    def __init__(self, fn: Any, out: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for o, v in zip(self.out, self.fn()):
            o.copy_(v)


def _captured(fn: Any) -> tuple[_Graph, Any]:
    out = tuple(t.clone() for t in fn())
    return _Graph(fn, out), out


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []

    def counting(fn: Any) -> tuple[_Graph, Any]:
        made.append(1)
        return _captured(fn)

    monkeypatch.setattr(decision_graph, "captured", counting)
    return made


def _fn(grad: torch.Tensor) -> Any:
    return lambda x: (grad.norm() + x, x * 2)  # reads a "gradient" in place, and its input


def test_a_key_is_captured_when_seen_again_then_replayed_with_new_inputs(captures: list[int]) -> None:
    mg, grad = MeasureGraph(True), torch.tensor([3.0, 4.0])
    assert mg.run(_fn(grad), (torch.tensor(1.0),), "k")[0] == 6.0 and mg.eager == 1 and not captures  # first: eager
    out = mg.run(_fn(grad), (torch.tensor(2.0),), "k")  # second: captured, then replayed on this step's input
    assert captures == [1] and mg.replays == 1 and out[0] == 7.0 and out[1] == 4.0
    grad.mul_(2)  # the gradient changed in place (same address, same key): the replay reads it
    again = mg.run(_fn(grad), (torch.tensor(0.5),), "k")
    assert again[0] is out[0] and again[0] == 10.5 and mg.replays == 2 and captures == [1]


def test_alternating_keys_are_both_captured_and_old_ones_evicted(captures: list[int]) -> None:
    mg, grad = MeasureGraph(True), torch.ones(2)
    for key in ("a", "b", "a", "b", "a", "b"):
        mg.run(_fn(grad), (torch.tensor(0.0),), key)
    assert len(captures) == 2 and mg.replays == 4  # the allocator handing out two address sets in turn
    for key in ("c", "c", "d", "d", "e", "e"):
        mg.run(_fn(grad), (torch.tensor(0.0),), key)
    assert len(mg._graphs) == MeasureGraph.KEEP  # the oldest graphs (and their pools) let go


def test_captures_stop_at_the_cap(captures: list[int]) -> None:
    mg, grad = MeasureGraph(True), torch.ones(2)
    for i in range(MeasureGraph.MAX_CAPTURES + 3):
        mg.run(_fn(grad), (torch.tensor(0.0),), i)
        mg.run(_fn(grad), (torch.tensor(0.0),), i)
    assert len(captures) == MeasureGraph.MAX_CAPTURES  # an allocator that keeps moving the gradients: eager after


def test_an_input_that_is_none_or_changes_shape_is_part_of_the_key(captures: list[int]) -> None:
    mg, grad = MeasureGraph(True), torch.ones(2)
    fn = lambda x: (grad.sum() if x is None else grad.sum() + x.sum(),)  # noqa: E731
    for x in (None, None, torch.ones(1), torch.ones(3), torch.ones(3)):
        mg.run(fn, (x,), "k")
    assert len(captures) == 2 and mg.replays == 2


def test_a_failed_capture_warns_once_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fn: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decision_graph, "captured", failing)
    mg, grad = MeasureGraph(True), torch.ones(2)
    mg.run(_fn(grad), (torch.tensor(1.0),), "k")
    with pytest.warns(RuntimeWarning, match="measurement failed"):
        out = mg.run(_fn(grad), (torch.tensor(1.0),), "k")
    assert float(out[0]) == pytest.approx(2**0.5 + 1) and not mg.usable and "capturing" in str(mg.error)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mg.run(_fn(grad), (torch.tensor(1.0),), "k")  # no second warning
