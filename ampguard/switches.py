"""Implementation switches: environment variables for tests and benchmarks, not configuration.

No switch changes what the guard decides: each chooses between two implementations of a step
(docs/design.md), so that tests and benchmarks can compare them. They are read once per ``wrap``
(:class:`ampguard.pipeline.StepPipeline`), so one process may build guards with different switches
one after the other. Users configure the guard with :class:`ampguard.GuardConfig`, which has no
field for any of them.
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

    step_graph: bool = True
    """On CUDA, one rank and the local backend: with a fused optimizer (on the fused fast path, or without a
    GradScaler), measure the gradients, make the local vector, take the decision, pack the report's payload and
    (with a GradScaler) write the next scale in one execution (with a non-fused one, up to the host decision's
    copy), replayed as one CUDA graph where the gradients and the scale lie where they lay (the loss and
    GradScaler's ``found_inf`` copied into the graph's own buffers; :meth:`ampguard.pipeline.StepPipeline.measure`'s
    ``decide``), instead of a replay of the measurement, the vector's kernels, a replay of the decision and the copies
    after it. On since it ran on a CUDA device (H100s: bit for bit the run without it; host time a step adds on the
    fused MLP, stages apart -> step graph: +435 -> +90 us at stop 40, +615 -> +168 and +493 -> +131 us on two other
    leases at stop 41, +469 -> +151, +364 -> +90 and +511 -> +164 us on three more at stop 42, and GPT-2 350M +790
    -> +235 us; ``docs/design.md``, "What stop 40 taught" to "What stop 42 taught", ``benchmarks/RESULTS.md``);
    ``AMPGUARD_STEP_GRAPH=0`` turns it off (so does ``AMPGUARD_CUDA_GRAPH=0``)."""

    fused_fast_path: bool = True
    """With a GradScaler and a fused optimizer, measure the still-scaled gradients and let the
    optimizer's kernel unscale (and clip) them (:mod:`ampguard.pipeline`). ``AMPGUARD_FUSED_FAST_PATH=0``:
    unscale first, as with any other optimizer."""

    unfused_host_decision: bool = False
    """A non-fused optimizer off the CPU decides on the host (:func:`ampguard.policies.decide_host`, from one copy of
    the statistics, that step's one sync), as every one did before stop 55. Off (the default): it takes the tensor
    decision, as a fused one does, on the fast path where :meth:`ampguard.pipeline.StepPipeline.fast_path` allows
    (the still-scaled gradients measured, the decision in the step graph's replay), and learns the skip in one read
    of the decision's flag, where GradScaler's ``found_inf.item()`` was
    (:attr:`ampguard.pipeline.StepPipeline.unfused_fast`).
    ``AMPGUARD_UNFUSED_HOST_DECISION=1``: the host decision, for benchmarks that time both in one process."""

    early_skip: bool = False
    """A non-fused optimizer on the step graph (CUDA): the graph copies the decision's skip flag into pinned memory and
    records an external event as soon as the flag is made (:func:`ampguard.policies.rule`'s ``on_skip``), and the skip
    read waits on that event, not for the whole graph (the rest of the rule, the payload and the scale writes: 34 of
    the fp16 foreach graph's 71 ops in the CPU's census); at its end the graph also copies the payload into pinned
    memory with a second event (:class:`ampguard.payload.Landing`), so the reporter launches no copy. On an H100
    (stops 59 and 60, ``benchmarks/RESULTS.md``) tests/gpu passes whole with it on, and the read's wait falls from
    ~110 to ~45 µs, but the MLP foreach step's added host time does not: +144 / +155 µs against the default's
    +133 / +152, its four graph nodes costing ~20 µs a step and each step's copy out of the pinned buffer ~30-40
    (stop 60, ``cpu_stop60/land_split.py``). Off (the default) until a step pays less with it than without.
    ``AMPGUARD_EARLY_SKIP=1``: on."""

    fused_rule: bool = False
    """The step graph's local vector, decision and payload (``StepPipeline._tail``: ~45 small ops, each a kernel of
    the graph) compiled by ``torch.compile`` (inductor, ``fullgraph``) into a few kernels, with division rounded to
    nearest and no multiply-add contraction (``torch._inductor.config.eager_numerics.division_rounding``,
    ``emulate_precision_casts``), so that its bits are the op-by-op rule's; compiled on the first step that runs it
    (outside any capture: a capture takes the tail op by op where it would compile), captured into the step graph
    after that, each guard on its own copy of the code (dynamo's recompile limit is counted per code object). On CUDA
    only (:data:`ampguard.pipeline.FUSED_RULE_DEVICES`). Not with the early skip flag, whose copy and event record sit
    inside the rule. A compile that fails warns once and leaves the op-by-op rule. On an H100 (stops 62 and 64,
    ``benchmarks/results/gpu_stop62/``, ``gpu_stop64/``): 48 kernels, 56 us of device time a replay -> 6 kernels,
    12 us; 0 of 360 random decisions differ from the op-by-op rule in any bit since ``TensorOps.recip`` divides the
    constant one (7 did before); the MLP foreach step's added host time +164 / +177 -> +126 / +127 us (stop 62's
    lease; +183 -> +157 on stop 64's; +240 -> +249, no gain, on stop 65's). ``tests/gpu`` with it on failed 10 of 82 at
    stop 64 (a shared code object past dynamo's recompile limit, and a test's own arm) and 2 of 81 at stop 65, both
    failing with it off too; the run also showed a process's first guard failing its compile (the device's constants
    made inside the trace), fixed since. Off (the default) until the whole ``tests/gpu`` passes with it on and a
    lease's host-time arm shows its gain with no capture recorded op by op
    (``StepPipeline.fused_rule_capture_misses``): each guard pays a compile of seconds on its first step.
    ``AMPGUARD_FUSED_RULE=1``: on."""

    sentinel_batch: bool = False
    """``GuardConfig(sentinel=...)`` on CUDA: the watched block outputs held until the model's forward returns and read
    by one ``_foreach_norm(ord=1)`` per dtype, instead of one float32 sum (and a memset) each as they come
    (:mod:`ampguard.forensics.sentinel`). Stop 65's profile of the sentinel (an H100, GPT-2 124M b8): 15 sums of
    25 MB each at ~2.1 TB/s, 178 of its 183 us a step. Off (the default) until a device measures it against the sums;
    it holds outputs that autograd would have freed (an embedding's) to the forward's end.
    ``AMPGUARD_SENTINEL_BATCH=1``: on."""

    report_batch: bool = True
    """Decode, log and export healthy steps' reports in batches of up to :data:`ampguard.reporter.REPORT_BATCH`
    steps (:meth:`ampguard.reporter.Reporter.quiet`); a report that asks for anything is decoded at the next fixed
    point, with every report before it, as are all of them on a read, ``flush()``, ``state_dict()`` and ``close()``.
    ``AMPGUARD_REPORT_BATCH=0``: decode each at its fixed point (the behaviour before stop 45)."""


_SWITCH_VARIABLES = {"cuda_graph": "AMPGUARD_CUDA_GRAPH", "fused_fast_path": "AMPGUARD_FUSED_FAST_PATH",
                     "step_graph": "AMPGUARD_STEP_GRAPH", "report_batch": "AMPGUARD_REPORT_BATCH",
                     "unfused_host_decision": "AMPGUARD_UNFUSED_HOST_DECISION", "early_skip": "AMPGUARD_EARLY_SKIP",
                     "fused_rule": "AMPGUARD_FUSED_RULE", "sentinel_batch": "AMPGUARD_SENTINEL_BATCH"}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Switches)}


def implementation_switches(environ: Mapping[str, str] | None = None) -> Switches:
    """The :class:`Switches` from the environment (``os.environ`` unless ``environ`` is given):
    ``AMPGUARD_CUDA_GRAPH``, ``AMPGUARD_FUSED_FAST_PATH``, ``AMPGUARD_STEP_GRAPH``, ``AMPGUARD_REPORT_BATCH``,
    ``AMPGUARD_UNFUSED_HOST_DECISION``, ``AMPGUARD_EARLY_SKIP``, ``AMPGUARD_FUSED_RULE`` and
    ``AMPGUARD_SENTINEL_BATCH``, each ``"1"`` (on) or
    ``"0"`` (off); unset or empty: the field's default. Any other value raises ValueError naming the variable."""
    env = os.environ if environ is None else environ
    values = {}
    for field, variable in _SWITCH_VARIABLES.items():
        default = "1" if _DEFAULTS[field] else "0"
        raw = env.get(variable, "") or default
        if raw not in ("0", "1"):
            raise ValueError(f"{variable}={raw!r}; allowed: '0' (off) or '1' (on); unset: {default!r}, the default; "
                             "an implementation switch for tests and benchmarks")
        values[field] = raw == "1"
    return Switches(**values)
