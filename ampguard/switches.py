"""Implementation switches: environment variables for tests and benchmarks, not configuration.

Neither switch changes what the guard decides: each chooses between two implementations of a step
(docs/design.md), so that tests and benchmarks can compare them. They are read once per ``wrap``
(:class:`ampguard.pipeline.StepPipeline`), so one process may build guards with different switches
one after the other. Users configure the guard with :class:`ampguard.GuardConfig`, which has no
field for either.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

__all__ = ["Switches", "implementation_switches"]


@dataclasses.dataclass(frozen=True, slots=True)
class Switches:
    """Implementation switches, for tests and benchmarks only. Read by :func:`implementation_switches`
    once per ``wrap``."""

    cuda_graph: bool = True
    """On CUDA, capture the step decision in a CUDA graph on the second step and replay it (one launch
    instead of a few dozen), and replay the measurement of the gradients from graphs keyed by where they lie
    (:class:`ampguard.decision_graph.MeasureGraph`). ``AMPGUARD_CUDA_GRAPH=0``: run both eagerly."""

    fused_fast_path: bool = True
    """With a GradScaler and a fused optimizer, measure the still-scaled gradients and let the
    optimizer's kernel unscale (and clip) them (:mod:`ampguard.pipeline`). ``AMPGUARD_FUSED_FAST_PATH=0``:
    unscale first, as with any other optimizer."""


_SWITCH_VARIABLES = {"cuda_graph": "AMPGUARD_CUDA_GRAPH", "fused_fast_path": "AMPGUARD_FUSED_FAST_PATH"}


def implementation_switches(environ: Mapping[str, str] | None = None) -> Switches:
    """The :class:`Switches` from the environment (``os.environ`` unless ``environ`` is given):
    ``AMPGUARD_CUDA_GRAPH`` and ``AMPGUARD_FUSED_FAST_PATH``, each ``"1"`` (on, the default; also
    when unset or empty) or ``"0"`` (off). Any other value raises ValueError naming the variable."""
    env = os.environ if environ is None else environ
    values = {}
    for field, variable in _SWITCH_VARIABLES.items():
        raw = env.get(variable, "") or "1"
        if raw not in ("0", "1"):
            raise ValueError(f"{variable}={raw!r}; allowed: '0' (off) or '1' (on, the default); an implementation "
                             "switch for tests and benchmarks")
        values[field] = raw == "1"
    return Switches(**values)
