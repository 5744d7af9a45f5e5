"""MeasureGraph's bookkeeping (ampguard.decision_graph), on the CPU: when it runs eagerly, captures, replays,
drops a graph and gives up. The CUDA capture itself is replaced by a stand-in whose ``replay()`` recomputes
into the captured outputs, as a CUDA graph's replay rewrites its static tensors; the real capture, and its
values bit for bit, are tests/gpu/test_gpu_measure_graph.py's.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ampguard.decision_graph import MeasureGraph

from ._graphs import StandInGraphs as _Graphs


def _norms(grads: list[torch.Tensor]) -> Any:
    return lambda: torch.stack([g.norm() for g in grads])


def test_a_key_is_captured_at_its_second_sighting_and_replayed_after() -> None:
    grads = [torch.randn(4), torch.randn(3)]
    graphs = _Graphs()
    first = graphs.run("norms", _norms(grads), grads)
    assert graphs.captures == 0 and graphs.replays == 0  # first sighting: eager
    second = graphs.run("norms", _norms(grads), grads)
    assert graphs.captures == 1 and graphs.replays == 1
    grads[0].mul_(2.0)  # the same tensors, new values: a replay reads them where they lie
    third = graphs.run("norms", _norms(grads), grads)
    assert graphs.captures == 1 and graphs.replays == 2
    assert third is second  # the graph's own output, rewritten by the replay
    assert torch.equal(third, torch.stack([g.norm() for g in grads])) and not torch.equal(third, first)


def test_gradients_elsewhere_are_measured_eagerly() -> None:
    """Other tensors (other addresses) than the captured ones: never a replay of the captured graph."""
    graphs = _Graphs()
    for _ in range(3):
        grads = [torch.randn(4), torch.randn(3)]  # new tensors each step, kept alive so none reuses an address
        out = graphs.run("norms", _norms(grads), grads)
        assert torch.equal(out, torch.stack([g.norm() for g in grads]))
        graphs.kept = getattr(graphs, "kept", []) + grads  # type: ignore[attr-defined]
    assert graphs.captures == 0 and graphs.replays == 0


def test_kinds_and_scales_are_keys_of_their_own() -> None:
    grads = [torch.randn(5)]
    scale_a, scale_b = torch.ones(()), torch.ones(())
    graphs = _Graphs()
    for _ in range(2):
        graphs.run("norms", _norms(grads), grads)
        graphs.run("scaled", _norms(grads), grads, scale_a)
        graphs.run("scaled", _norms(grads), grads, scale_b)
    assert graphs.captures == 3


def test_at_most_max_graphs_are_kept_and_max_captures_made() -> None:
    graphs = _Graphs()
    graphs.MAX_GRAPHS = 4  # fewer kept than credits: the first captures are dropped before they replay
    sets = [[torch.randn(2)] for _ in range(graphs.MAX_CAPTURES + 2)]
    for grads in sets:  # each set seen twice: captured
        graphs.run("norms", _norms(grads), grads)
        graphs.run("norms", _norms(grads), grads)
    assert graphs.captures == graphs.MAX_CAPTURES  # the last two sets: eager
    assert len(graphs._graphs) == graphs.MAX_GRAPHS
    replays = graphs.replays
    graphs.run("norms", _norms(sets[0]), sets[0])  # dropped long ago, and no capture left: eager
    assert graphs.replays == replays and graphs.captures == graphs.MAX_CAPTURES
    last = sets[graphs.MAX_CAPTURES - 1]
    graphs.run("norms", _norms(last), last)  # the most recent capture is kept: replayed
    assert graphs.replays == replays + 1


def test_gradients_that_take_three_places_in_turn_are_all_replayed() -> None:
    """A steady CUDA loop's gradients may take three places in turn (an H100, stop 42,
    ``benchmarks/gpu_graph_keys.py``: the bf16 fused step graph and the stages' measurement). Each place is
    captured once and replayed from then on; with two graphs kept, least recently used dropped, each capture
    dropped the one needed next, and every step captured again until MAX_CAPTURES ran out."""
    graphs = _Graphs()
    places = [[torch.randn(3), torch.randn(2)] for _ in range(3)]
    for _ in range(8):
        for grads in places:
            out = graphs.run("norms", _norms(grads), grads)
            assert torch.equal(out, torch.stack([g.norm() for g in grads]))
    assert graphs.captures == 3 and graphs.replays == 3 * 7, (graphs.captures, graphs.replays)


def test_a_failed_capture_warns_once_and_measures_eagerly_from_then_on() -> None:
    grads = [torch.randn(4)]
    graphs = _Graphs(fail=True)
    graphs.run("norms", _norms(grads), grads)
    with pytest.warns(RuntimeWarning, match="capture of the gradient measurement failed"):
        out = graphs.run("norms", _norms(grads), grads)
    assert torch.equal(out, torch.stack([g.norm() for g in grads]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            graphs.run("norms", _norms(grads), grads)
    assert graphs.captures == 0 and graphs.replays == 0


def test_switched_off_or_off_cuda_it_runs_eagerly() -> None:
    grads = [torch.randn(4)]
    off = _Graphs()
    off.enabled = False
    cpu = MeasureGraph(True)  # the real one: the CPU is not capturable
    for graphs in (off, cpu):
        for _ in range(3):
            graphs.run("norms", _norms(grads), grads)
        assert graphs.captures == 0 and graphs.replays == 0


def test_gradients_of_another_dtype_where_the_captured_ones_lay_are_not_replayed() -> None:
    """The parameters' dtype changed after the capture (``model.to(torch.bfloat16)``: ``param.data`` swapped, the
    same Parameter objects), and the new gradients happen to lie at the captured addresses: the captured kernels
    read float32 there, so replaying them would give the norms of reinterpreted bits. A key of its own."""
    storage = [torch.randn(8), torch.randn(6)]
    graphs = _Graphs()
    for _ in range(2):
        graphs.run("norms", _norms(storage), storage)
    assert graphs.captures == 1
    halves = [s.view(torch.bfloat16) for s in storage]  # the same addresses, read as bfloat16
    assert [h.data_ptr() for h in halves] == [s.data_ptr() for s in storage]
    out = graphs.run("norms", _norms(halves), halves)
    assert graphs.replays == 1  # only the capture's own replay: eager
    # float32 bits read as bfloat16 can be NaN or inf (a low half's exponent all ones, ~5 % of runs): NaN equal here
    assert torch.allclose(out, torch.stack([h.norm() for h in halves]), rtol=0, atol=0, equal_nan=True)


def test_a_failed_capture_names_what_failed_and_its_switch() -> None:
    """The step graph's failure is its own (StepPipeline.step_graph is another MeasureGraph): its warning names it
    and the switch that turns it off."""
    grads = [torch.randn(4)]
    graphs = _Graphs(True, "the step from the gradients to the decision", "AMPGUARD_STEP_GRAPH=0")
    graphs.run("norms", _norms(grads), grads)
    with pytest.warns(RuntimeWarning, match=r"capture of the step from the gradients to the decision failed .*"
                                            r"AMPGUARD_STEP_GRAPH=0"):
        graphs.run("norms", _norms(grads), grads)


def test_a_long_run_whose_gradients_move_now_and_then_keeps_replaying() -> None:
    """A long fp16 run's gradients move once in a while (each overflow arms forensics, whose hooks move them; an
    evaluation or a checkpoint between steps): each new place is captured and replayed, however many there have
    been. Before stop 44 a guard's captures were for life: from the ninth place on, every step ran eagerly."""
    graphs = _Graphs()
    for place in range(12):  # 12 places, 200 steps each
        grads = [torch.randn(3), torch.randn(2)]
        replays = graphs.replays
        for _ in range(200):
            out = graphs.run("norms", _norms(grads), grads)
        assert torch.equal(out, torch.stack([g.norm() for g in grads]))
        assert graphs.replays - replays == 199, (place, graphs.replays - replays, graphs.captures)
    assert graphs.captures == 12


def test_gradients_in_more_places_than_graphs_kept_capture_at_most_once_in_128_steps() -> None:
    """One place more than the graphs kept, in turn, least recently used dropped: while credits last every run is a
    new capture (the one needed next was just dropped). The credits bound it: MAX_CAPTURES captures, then one in
    128 runs (and the graphs kept meanwhile replay)."""
    graphs = _Graphs()
    places = [[torch.randn(3)] for _ in range(graphs.MAX_GRAPHS + 1)]
    rounds = 40
    for _ in range(rounds):
        for grads in places:
            graphs.run("norms", _norms(grads), grads)
    runs = rounds * len(places)
    assert graphs.captures <= graphs.MAX_CAPTURES + runs * graphs.CREDIT_PER_RUN, graphs.captures
    assert graphs.captures > graphs.MAX_CAPTURES  # and the credits came back


def test_gradients_in_a_cycle_of_18_places_are_all_captured_and_replayed() -> None:
    """Inside the transformers Trainer (stop 62, an H100: ``benchmarks/results/gpu_stop62/fw_graph_keys.txt``) GPT-2
    124M's gradients took 21 places, the last 18 in a cycle (``abc`` then ``defghijklmnopqrstu`` again and again),
    and the measurement never replayed: 4 graphs kept and 16 keys remembered, a key was forgotten before it came
    back. Each place is now captured at its second sighting and replayed from its third on."""
    graphs = _Graphs()
    head = [[torch.randn(3), torch.randn(2)] for _ in range(3)]
    cycle = [[torch.randn(3), torch.randn(2)] for _ in range(18)]
    order = head + cycle * 12  # 219 steps
    did = []
    for grads in order:
        captures, replays = graphs.captures, graphs.replays
        out = graphs.run("norms", _norms(grads), grads)
        assert torch.equal(out, torch.stack([g.norm() for g in grads]))
        did.append("C" if graphs.captures > captures else "R" if graphs.replays > replays else "e")
    assert graphs.captures == 18, "".join(did)
    assert "".join(did[:3 + 18]) == "e" * (3 + 18) and "".join(did[3 + 18:3 + 36]) == "C" * 18, "".join(did)
    assert "".join(did[3 + 36:]) == "R" * 18 * 10, "".join(did)  # from the third turn on, every step replays
