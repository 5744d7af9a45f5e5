"""A stand-in for the CUDA capture of ``ampguard.decision_graph.MeasureGraph``, on the CPU (tests/unit's graph tests).

A CUDA capture records the kernels without running them, and a replay runs them again into the graph's static
outputs. Here the capture runs the function once, for the outputs (a tensor, or a tuple of tensors and Nones), and
puts back the ``state`` that run wrote (the tensors the function writes in place); a replay runs the function again
and copies its results into those outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampguard.decision_graph import MeasureGraph


class StandIn:
    def __init__(self, fn: Any, out: Any) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
            return
        for out, value in zip(self.out, new):
            if out is not None:
                out.copy_(value)


class StandInGraphs(MeasureGraph):
    """MeasureGraph with the CPU taken as capturable and the capture made by :class:`StandIn` (``fail``: every
    capture raises, as a capture that is not permitted does)."""

    def __init__(self, fail: bool = False, *names: str, state: Sequence[torch.Tensor] = ()) -> None:
        super().__init__(True, *names)
        self.fail, self.state = fail, list(state)

    @staticmethod
    def capturable(device: torch.device) -> bool:
        return True

    def _capture(self, fn: Any, device: torch.device) -> tuple[Any, Any]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        saved = [t.clone() for t in self.state]
        out = fn()
        out = out.clone() if isinstance(out, torch.Tensor) else tuple(None if t is None else t.clone() for t in out)
        for t, s in zip(self.state, saved):
            t.copy_(s)
        return StandIn(fn, out), out
