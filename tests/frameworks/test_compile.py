"""torch.compile: armed forensics and fault injection on a compiled nanoGPT-style model, bf16 on CPU.

Backend: ``aot_eager`` (dynamo + AOTAutograd, no code generation), wrapped to count the graphs it is
handed. Dynamo is where module hooks meet the compiled code (traced, guarded, graph breaks) and
AOTAutograd is where gradient hooks meet the compiled backward; inductor only generates kernels for
the same graphs. Measured on 2 cores, this GPT's first (compiling) step: aot_eager 4.4 s, inductor
82 s with a cold cache, too slow for a file that compiles 7 times. The same scenarios run once with
inductor gave the same graph counts and results.

What is counted: every graph dynamo hands the backend (one per compiled frame piece; recompiles
included). "Bounded" here means no graph after the warm-up step: not per step, not when forensics
arms (the model then runs eagerly) or disarms (the cached compiled code fits again).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

import ampguard
from ampguard import faults
from ampguard.forensics.localizer import Localizer

from ..unit._models import step_once

pytestmark = pytest.mark.frameworks

VOCAB, WIDTH, HEADS, SEQ, LAYERS = 32, 16, 2, 8, 2


class CausalSelfAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.gelu = torch.nn.GELU()
        self.c_proj = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.ln_2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(VOCAB, WIDTH), wpe=torch.nn.Embedding(SEQ, WIDTH),
            h=torch.nn.ModuleList(Block() for _ in range(LAYERS)), ln_f=torch.nn.LayerNorm(WIDTH)))
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


class CountingBackend:
    """``aot_eager``, counting the graphs dynamo compiles and the calls of compiled graphs."""

    def __init__(self) -> None:
        self.graphs = 0
        self.runs = 0
        self._backend = lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        compiled = self._backend(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    gc.collect()  # a guard dropped while armed (another test's) gives the force_eager stance back
    torch._dynamo.reset()  # code caches are per code object: no test sees another's compiled code
    assert torch._dynamo.eval_frame._stance.stance == "default"
    yield
    torch._dynamo.reset()


def _setup(guard_gets: str, compile_how: str = "wrapper", **config):
    torch.manual_seed(0)
    model = GPT()
    counter = CountingBackend()
    if compile_how == "in_place":
        model.compile(backend=counter)
        compiled: torch.nn.Module = model
    else:
        compiled = torch.compile(model, backend=counter, fullgraph=compile_how == "fullgraph")
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3),
                        model=compiled if guard_gets == "compiled" else model, precision="bf16",
                        config=ampguard.GuardConfig(**config) if config else None)
    return model, compiled, counter, opt


def _train(opt, compiled, counter, steps: int, *, closure: bool = False, before_step=None,
           runs: list[int] | None = None) -> list[int]:
    """Train ``steps`` steps; the number of graphs compiled so far, after each step (and in ``runs``
    the number of compiled-graph calls so far)."""
    g = torch.Generator().manual_seed(3)
    graphs = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)

        def run(tokens=tokens):
            opt.zero_grad()
            with opt.autocast():
                _, loss = compiled(tokens[:, :-1], tokens[:, 1:])
            opt.backward(loss)

        step_once(opt, run, closure=closure)
        graphs.append(counter.graphs)
        if runs is not None:
            runs.append(counter.runs)
    return graphs


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize(("guard_gets", "compile_how"), [
    ("compiled", "wrapper"), ("original", "wrapper"), ("original", "in_place"), ("original", "fullgraph")])
def test_compiled_gpt_forensics_names_the_block_without_recompiling(guard_gets, compile_how):
    model, compiled, counter, opt = _setup(guard_gets, compile_how, forensics_window=1)
    # step 2: a first NaN arms the hooks; step 3 (armed): named; step 4 clean: disarmed (window 1).
    inj = faults.inject(opt, faults.output("transformer.h.1", "nan", steps=[2, 3]))
    runs: list[int] = []
    graphs = _train(opt, compiled, counter, 7, runs=runs)
    assert [s for s, _, _ in inj.fired] == [2, 3]
    assert [r.step for r in opt.history if r.skipped] == [2, 3]
    assert all(math.isfinite(opt.history[s].loss) for s in (0, 1, 4, 5, 6))
    assert _finite(model)
    assert opt._forensics.localizer is None  # disarmed after the clean step 4
    named = {a.step: a for a in opt.anomalies}
    assert named[2].module is None  # not armed yet
    # an injected value, no replay: "not reproduced by recompute" (issue 14: "transient" needs a clean replay)
    assert (named[3].module, named[3].phase, named[3].cause) == ("transformer.h.1", "forward", "not_reproduced")
    assert not any("_orig_mod" in n for n in opt.param_names)
    # Compiled once, on step 0; nothing after: not per step, not on arming (steps 3-4 run eagerly),
    # not on disarming (steps 5-6 run the cached compiled code).
    assert 1 <= graphs[0] <= 8, graphs
    assert graphs[-1] == graphs[0], graphs
    per_step = [b - a for a, b in zip([0, *runs], runs)]
    assert per_step[3] == per_step[4] == 0, per_step  # armed: eager
    assert all(n > 0 for n in per_step[:3] + per_step[5:]), per_step  # compiled code runs
    inj.remove()
    opt.close()


def test_compiled_gpt_replay_names_the_block_on_the_step_itself():
    model, compiled, counter, opt = _setup("compiled")
    inj = faults.inject(opt, faults.output("transformer.h.0.mlp", "nan", steps=[2]))
    graphs = _train(opt, compiled, counter, 4, closure=True)
    a = next(a for a in opt.anomalies if a.step == 2)
    assert (a.module, a.phase) == ("transformer.h.0.mlp", "forward")
    assert [s for s, _, _ in inj.fired] == [2, 2]  # the step and its replay (run eagerly)
    assert [r.step for r in opt.history if r.skipped] == [2] and _finite(model)
    assert graphs[-1] == graphs[0], graphs
    opt.close()  # armed until then: the stance goes back with it
    assert torch._dynamo.eval_frame._stance.stance == "default"


@pytest.mark.parametrize("compile_how", ["wrapper", "fullgraph"])
def test_faults_on_a_compiled_gpt_fire_at_their_steps_without_per_step_recompiles(compile_how):
    # Forensics off: the model stays compiled on every step. Injected after step 0 compiled it.
    model, compiled, counter, opt = _setup("compiled", compile_how, forensics=False)
    schedule = [faults.output("transformer.h.0", "nan", steps=[2, 6]),
                faults.backward("transformer.h.1.mlp", "inf", steps=[3]),  # h.1's code was compiled on h.0
                faults.grad("transformer.h.0.attn.c_attn.weight", "nan", steps=[4]),
                faults.loss("nan", steps=[5])]
    injection: list[faults.Injection] = []

    def before_step(step: int) -> None:
        if step == 1:
            injection.append(faults.inject(opt, *schedule))
        if step == 8:
            injection[0].remove()

    runs: list[int] = []
    graphs = _train(opt, compiled, counter, 9, before_step=before_step, runs=runs)
    inj = injection[0]
    assert sorted((s, f.where) for s, _, f in inj.fired) == [
        (2, "output"), (3, "backward"), (4, "grad"), (5, "loss"), (6, "output")]
    assert [r.step for r in opt.history if r.skipped] == [2, 3, 4, 5, 6]
    assert opt.history[3].reason == "nonfinite_grad" and not opt.history[3].nonfinite_loss
    assert _finite(model)
    # Step 1 traces the marked modules again, hooks in the graph (measured: one graph); nothing per
    # step after; remove() puts the classes back and the code compiled on step 0 fits (measured: 0).
    assert 1 <= graphs[1] - graphs[0] <= 2, graphs
    assert len(set(graphs[1:8])) == 1 and graphs[8] - graphs[7] <= 1, graphs
    assert all(b > a for a, b in zip([0, *runs], runs)), runs  # every step ran compiled code
    opt.close()


def test_gradient_hooks_accept_none():
    # A gradient hook gets None where no gradient flowed (e.g. an output of a compiled graph that
    # does not require grad): nothing to check, no crash.
    torch.manual_seed(0)
    model = GPT()
    loc = Localizer(torch.compile(model, backend="eager"))
    try:
        assert loc.modules[0] == ("", model) and all("_orig_mod" not in n for n, _ in loc.modules)
        loc._out_grad_hook(1)(None)
        loc._in_grad_hook(1)(None)
        assert not loc._flags and not loc._grad_in  # nothing recorded
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"  # armed: compiled code runs eagerly
    finally:
        loc.remove()
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_localizer_dropped_while_armed_gives_the_stance_back():
    torch.manual_seed(0)
    model = GPT()
    loc = Localizer(model)
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    del loc  # e.g. a guard dropped while armed: the model's hooks do not keep the Localizer alive
    gc.collect()
    assert torch._dynamo.eval_frame._stance.stance == "default"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
