"""Under torch.compile the fp8 monitor's amaxes are torchao's own reductions (issue 28): the monitor's hook (and the
grad_output probe, in the backward) runs the aten ops torchao's Float8Linear runs on the tensor it casts, and
AOTAutograd's common-subexpression elimination merges them. Proved without timing: a torch.compile backend built on
aot_autograd, with inductor's decompositions and inductor's partitioner (its joint-graph passes, then the min-cut
partition, which runs the CSE), records the forward and backward graphs as inductor would get them, and the
reductions in them are counted, monitored and not.
Real torchao float8 training (CPU: ``Float8LinearConfig(emulate=True)``)."""

from __future__ import annotations

import collections
import contextlib
import math

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8")

from ampguard.fp8 import Fp8Monitor  # noqa: E402
from tests.unit.test_fp8 import _model  # noqa: E402  (the two-layer float8 model: 16 -> 32 -> 16)

aten = torch.ops.aten
_REDUCTIONS = {aten.max.default, aten.max.dim, aten.amax.default, aten.min.default, aten.min.dim, aten.amin.default,
               aten.linalg_vector_norm.default, aten.sum.default, aten.sum.dim_IntList, aten.mean.default,
               aten.mean.dim, aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim,
               aten.prod.default, aten.argmax.default, aten.argmin.default}
_BATCH = 8
_ROWWISE_PROBES = collections.Counter({(str(aten.amax.default), (_BATCH, 1)): 1, (str(aten.amax.default), (1, 32)): 1})
"""The rowwise grad_output probes' reductions over torchao's row amaxes: fc2's (grad_input's cast, 8 rows) and
fc1's (grad_weight's cast, 32 columns)."""


pytestmark = pytest.mark.usefixtures("compile_state")


def _recording_backend(graphs: dict[str, list[torch.fx.GraphModule]]):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn, select_decomp_table

    def recorder(kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)  # the graph as traced, run by aten's eager kernels
        return compiler

    # partition_fn: inductor's joint-graph passes (which remove no-op copies), then the min-cut partition (whose
    # first step is fx_graph_cse): the graphs inductor's lowering would get.
    return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"),
                        decompositions=select_decomp_table(), partition_fn=partition_fn)


def _reductions(gm: torch.fx.GraphModule) -> collections.Counter:
    """The graph's reductions: (op, shape of the tensor reduced) -> how many."""
    return collections.Counter((str(n.target), tuple(n.args[0].meta["val"].shape)) for n in gm.graph.nodes
                               if n.op == "call_function" and n.target in _REDUCTIONS)


@contextlib.contextmanager
def _autocast(enabled: bool):
    """bf16 autocast as torchao's Float8Linear sees it on a GPU, on this CPU: it casts its input to
    ``torch.get_autocast_gpu_dtype()`` where ``torch.is_autocast_enabled()`` (CUDA's autocast state, a thread-local
    flag that a CPU-only build sets too), the monitor to the autocast dtype of the input's device (the CPU's)."""
    if not enabled:
        yield
        return
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


def _compiled_step(recipe: str, dtype: torch.dtype, *, monitored: bool, step: int = 1, x: torch.Tensor | None = None,
                   autocast: bool = False):
    """One compiled training step of a fresh model; the forward and backward graphs' reductions, and collect()."""
    torch._dynamo.reset()
    model = _model(recipe).to(dtype)
    monitor = Fp8Monitor(model, numerics_every=2) if monitored else None
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
    compiled = torch.compile(model, backend=_recording_backend(graphs))
    if monitor is not None:
        monitor.begin_step(step)
    x = torch.randn(_BATCH, 16, dtype=dtype) if x is None else x
    with _autocast(autocast):
        out = compiled(x)
    out.float().square().mean().backward()
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1  # one graph: no break
    collected = None
    if monitor is not None:
        collected = monitor.collect()
        monitor.close()
    return _reductions(graphs["forward"][0]), _reductions(graphs["backward"][0]), collected


@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, False), (torch.bfloat16, False),
                                                 (torch.float32, True)])
def test_a_compiled_unsampled_step_adds_no_reduction_under_the_tensorwise_recipe(dtype, autocast):
    """Tensorwise: the monitored forward graph holds exactly the unmonitored one's reductions (torchao's
    ``max(abs(x))`` of each input, after autocast's ``x.to(bfloat16)``, and ``max(abs(weight.t()))`` of each
    weight): the monitor's four amaxes are torchao's. So is each grad_output probe's in the backward graph (torchao's
    ``max(abs(grad_output.reshape(-1, n)))``)."""
    plain_fw, plain_bw, _ = _compiled_step("tensorwise", dtype, monitored=False, autocast=autocast)
    fw, bw, _ = _compiled_step("tensorwise", dtype, monitored=True, autocast=autocast)
    # fc1's input (8, 16) and weight (16, 32 as weight.t()), fc2's input (8, 32) and weight (32, 16): one each
    assert {(16, 32), (32, 16)} <= {shape for _, shape in plain_fw}
    assert fw == plain_fw, f"monitored {dict(fw)} vs unmonitored {dict(plain_fw)}"
    assert bw == plain_bw


@pytest.mark.parametrize("autocast", [False, True])
def test_a_compiled_unsampled_step_under_the_rowwise_recipe_adds_one_reduction_over_the_row_amaxes_a_cast(autocast):
    """Rowwise: torchao's per-row amaxes are merged too; the monitor adds one reduction a cast, of the row
    amaxes (one value a row) to the cast's amax: 8 of fc1's and fc2's input rows, fc1's 32 and fc2's 16 weight
    rows (weight.t()'s columns); in the backward, one a layer over the row amaxes of torchao's grad_output cast that
    the compiled backward keeps: fc2's grad_input cast (8 rows), fc1's grad_weight cast (its 32 columns: fc1's input
    needs no gradient, so its grad_input cast is dead code). No tensor is read a second time."""
    plain_fw, plain_bw, _ = _compiled_step("rowwise", torch.float32, monitored=False, autocast=autocast)
    fw, bw, _ = _compiled_step("rowwise", torch.float32, monitored=True, autocast=autocast)
    assert not plain_fw - fw  # every reduction of the unmonitored graph is there once
    added = fw - plain_fw
    amax = str(aten.amax.default)
    assert added == collections.Counter({(amax, (_BATCH, 1)): 2, (amax, (1, 32)): 1, (amax, (1, 16)): 1}), added
    assert not plain_bw - bw
    assert bw - plain_bw == _ROWWISE_PROBES, bw - plain_bw


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_compiled_sampled_step_reads_each_cast_tensor_once_more_not_twice(recipe, autocast):
    """A sampled step runs cast_stats on each of the forward's 4 casts and the backward's 2, on the tensor reshaped to
    rows (the weight as it is, not transposed), its row amaxes torchao's (merged): over the whole tensor (these are
    smaller than ``Fp8Monitor.sample``), the underflow's sum and the smallest non-zero |x| (one more read, which
    inductor can fuse into one kernel); over the row amaxes (one value a row, tensorwise one), their largest and the
    smallest row scale, and rowwise whether one is NaN. Counted over the step (forward and backward together): the
    min-cut partition may move one of torchao's own reductions between them (rowwise under autocast it takes fc2's
    input's dim-0 amax, for grad_weight's cast, into the forward and saves its result instead of the input)."""
    plain_fw, plain_bw, _ = _compiled_step(recipe, torch.float32, monitored=False, autocast=autocast)
    fw, bw, collected = _compiled_step(recipe, torch.float32, monitored=True, step=0, autocast=autocast)
    assert not collected[:, 3].isnan().all()  # sampled: the underflow was measured
    amax, amin, total, any_ = (str(op) for op in (aten.amax.default, aten.amin.default, aten.sum.default,
                                                   aten.any.default))
    expected: collections.Counter = collections.Counter()
    for shape in ((_BATCH, 16), (32, 16), (_BATCH, 32), (16, 32)):  # fc1's input and weight, fc2's
        rows = (shape[0], 1) if recipe == "rowwise" else (1, 1)
        expected.update([(total, shape), (amin, shape), (amax, rows), (amin, rows)] + [(any_, rows)] * (
            recipe == "rowwise"))
    # The backward: the same for both grad_output casts (fc2's and fc1's output gradients, through the sampled probe,
    # fp8._GradStatsProbe), the rows' amaxes torchao's (merged); rowwise, fc1's grad_output is reduced by torchao
    # over its columns only (its input needs no gradient: no grad_input cast), so its row amaxes are one read more.
    for shape in ((_BATCH, 16), (_BATCH, 32)):
        rows = (shape[0], 1) if recipe == "rowwise" else (1, 1)
        expected.update([(total, shape), (amin, shape), (amax, rows), (amin, rows)] + [(any_, rows)] * (
            recipe == "rowwise"))
    if recipe == "rowwise":
        expected.update([(amax, (_BATCH, 32))])
    step, plain = fw + bw, plain_fw + plain_bw
    assert not plain - step
    assert step - plain == expected, step - plain


@pytest.mark.parametrize("step", [1, 0], ids=["unsampled", "sampled"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, False), (torch.bfloat16, False),
                                                 (torch.float32, True)])
def test_the_compiled_statistics_are_bitwise_the_eager_ones(recipe, dtype, autocast, step):
    """The compiled hook's and probe's statistics (torchao's reductions) are bitwise the eager hooks' (vector_norm, the
    autocast rounding in collect(); sampled: cast_stats), also with a NaN or an Inf in the batch."""
    torch._dynamo.reset()
    models = _model(recipe).to(dtype), _model(recipe).to(dtype)
    monitors = [Fp8Monitor(m, numerics_every=2) for m in models]
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
    runs = torch.compile(models[0], backend=_recording_backend(graphs)), models[1]
    for bad in (None, math.nan, math.inf):
        torch.manual_seed(2)
        x = (torch.randn(_BATCH, 16) * 3).to(dtype)
        x[1, 2], x[5, 7] = 1e-3, 7.25e4
        if bad is not None:
            x[4, 4] = bad
        compiled, eager = [], []
        for run, model, monitor, rows in zip(runs, models, monitors, (compiled, eager)):
            monitor.begin_step(step)
            with _autocast(autocast):
                out = run(x)
            out.float().square().mean().backward()
            model.zero_grad()
            rows.append(monitor.collect())
        (compiled_rows,), (eager_rows,) = compiled, eager
        # every cast (grad_output's from the probe), in the same order; the forward's casts (orders 1-4) with their
        # underflow and dynamic range too (a probe carries one float)
        assert torch.allclose(compiled_rows[:, :3], eager_rows[:, :3], rtol=0, atol=0, equal_nan=True)
        forward = eager_rows[:, 0] <= 2 * 2
        assert torch.allclose(compiled_rows[forward], eager_rows[forward], rtol=0, atol=0, equal_nan=True)
        assert compiled_rows[forward, 1].isfinite().all() == (bad is None)
        assert compiled_rows[forward, 3].isnan().all() == (step == 1)
    assert len(graphs["forward"]) == 1  # compiled once, no break


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_torchaos_ops_give_the_amax_bitwise(role, rowwise):
    """_torchao_amax (torchao's ops, the compiled path) against vector_norm(x, inf) (the eager path), eagerly."""
    from ampguard.fp8 import _torchao_amax

    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bad in (None, math.nan, math.inf, -math.inf, -0.0):
            x = torch.randn(2, 6, 10, dtype=dtype) if role == "input" else torch.randn(12, 10, dtype=dtype)
            if bad is not None:
                x.view(-1)[7] = bad
            if bad == -0.0:
                x.zero_()
                x.view(-1)[7] = bad
            got = _torchao_amax(x, role, rowwise=rowwise)
            want = torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32)
            assert got.dtype == torch.float64 and got.dim() == 0
            assert torch.equal(got.float(), want) or (got.isnan() and want.isnan()), (dtype, bad, got, want)
            assert torch.equal(got.float().view(torch.int32), want.view(torch.int32)) or bad is math.nan
