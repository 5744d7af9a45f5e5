"""The opt-in coarse sentinel (issue 14, item 4): a block named on the step it goes non-finite,
without a closure, and the fine hooks then armed inside that block only.

Every test runs twice: the outputs summed as they come, and batched (``AMPGUARD_SENTINEL_BATCH=1``, stop 65: held to
the model's return and read by one ``_foreach_norm`` per dtype; CUDA's alone outside the tests), which must name the
same blocks on the same steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard
from ampguard import faults
from ampguard.forensics import sentinel as sentinel_module
from ampguard.forensics.sentinel import Sentinel, top_blocks

from .test_decision_kernels import _Ops
from .test_forensics import batches, lm
from .test_forensics import train as train_lm

PER_OUTPUT_ONLY = {"test_a_bf16_model_on_the_cpu_is_summed_without_a_float32_copy_of_each_output"}
"""The CPU's own sum (its bf16 path): the batched read is CUDA's."""


@pytest.fixture(autouse=True, params=["per_output", "batched"])
def read_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "batched":
        if request.node.originalname in PER_OUTPUT_ONLY:
            pytest.skip("the CPU's own sum: batched reads are CUDA's")
        monkeypatch.setattr(sentinel_module, "BATCH_DEVICES", ("cuda", "cpu"))
        monkeypatch.setenv("AMPGUARD_SENTINEL_BATCH", "1")  # read when the sentinel is made
    return request.param


def hooked(model: torch.nn.Module) -> dict[str, int]:
    counts = {name: len(m._forward_hooks) + len(m._forward_pre_hooks) for name, m in model.named_modules()}
    return {name: n for name, n in counts.items() if n}


def train(opt, model, data, lagged=False):
    opt._lagged_reports = lagged  # True: the fused-CUDA report lag, emulated on CPU
    train_lm(opt, model, data)
    opt.flush()


def test_top_blocks_are_the_repeated_blocks_and_the_layers_around_them():
    assert top_blocks(lm()) == ["emb", *(f"blocks.{i}" for i in range(6)), "head"]
    gpt = torch.nn.Module()
    gpt.transformer = torch.nn.Module()
    gpt.transformer.wte = torch.nn.Embedding(4, 4)
    gpt.transformer.h = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    gpt.lm_head = torch.nn.Linear(4, 4)
    assert top_blocks(gpt) == ["transformer.wte", "transformer.h.0", "transformer.h.1", "lm_head"]


def test_off_by_default_and_on_it_hooks_only_the_blocks():
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16")
    train(opt, model, batches(2))
    assert hooked(model) == {}  # sentinel off: a healthy run registers no hook
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    train(opt, model, batches(2))
    # one forward hook per top-level block, a pre-hook on the model for its input and a hook for its output
    # (whether the last block's output is the model's: see test_the_models_output_is_read_through_the_loss), nothing
    # inside
    assert hooked(model) == {"": 2, "emb": 1, **{f"blocks.{i}": 1 for i in range(6)}, "head": 1}
    assert all(not r.skipped for r in opt.history)
    opt.close()
    assert hooked(model) == {}


@pytest.mark.parametrize("lagged", [False, True], ids=["cpu", "fused_cuda_lag"])
def test_names_the_block_on_the_same_step_then_arms_inside_it_only(lagged):
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model,
                        precision="bf16", config={"sentinel": "top"})
    faults.inject(opt, faults.output("blocks.2.mlp", "nan", steps=range(3, 7)))
    train(opt, model, batches(7), lagged=lagged)
    by_step = {a.step: a for a in opt.anomalies}
    # step 3: no closure, no hook inside any block, yet the block is named on the step itself
    assert (by_step[3].module, by_step[3].phase, by_step[3].cause) == ("blocks.2", "forward", None)
    assert "Sentinel" in by_step[3].detail
    # the fine hooks arm inside blocks.2 only; from the step their first forward ran, the module
    # inside the block is named, and classified
    first_fine = 6 if lagged else 4  # the fused-CUDA report lag: step 3's report is decoded at step 5's step()
    assert by_step[first_fine - 1].module == "blocks.2"
    for step in range(first_fine, 7):
        assert (by_step[step].module, by_step[step].phase, by_step[step].cause) == (
            "blocks.2.mlp", "forward", "not_reproduced"), by_step[step]
    inside = {n for n in hooked(model) if n.startswith("blocks.2.") or n == "blocks.2.mlp"}
    outside = {n: c for n, c in hooked(model).items() if n not in inside and n != "blocks.2"}
    # only the sentinel's hooks out there (on the model: its input's and its output's)
    assert inside and outside.pop("") == 2 and all(c == 1 for c in outside.values())


def test_input_inf_is_named_on_the_same_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        config={"sentinel": "top"})
    for step in range(3):
        x = torch.randn(4, 8)
        if step == 1:
            x[0, 0] = float("inf")
        with opt.autocast():
            loss = model(x).float().pow(2).mean()
        opt.backward(loss, batch_id=step)
        opt.step()
        opt.zero_grad()
    (a,) = opt.anomalies
    assert (a.step, a.module, a.phase) == (1, None, "input") and opt.quarantine == [1]


def test_bad_sentinel_config_is_refused():
    with pytest.raises(ValueError, match="sentinel"):
        ampguard.GuardConfig(sentinel="all")
    model = lm()
    with pytest.raises(ValueError, match=r"no module named 'blocks\.9'"):
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, precision="bf16",
                      config={"sentinel": ["blocks.9"]})
    with pytest.raises(ValueError, match="needs the model"):
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", config={"sentinel": "top"})


def test_a_fault_outside_the_watched_block_widens_the_hooks_to_the_whole_model():
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    faults.inject(opt, faults.output("blocks.2.mlp", "nan", steps=[2]),  # the sentinel: hooks inside blocks.2
                  faults.backward("blocks.4.mlp", "inf", steps=[4, 5]))  # then a fault elsewhere, in backward
    train(opt, model, batches(6))
    by_step = {a.step: a for a in opt.anomalies}
    assert by_step[2].module == "blocks.2"
    # step 4: the gradient reaching blocks.2 was already non-finite: not blamed on anything inside it
    assert (by_step[4].module, by_step[4].phase, by_step[4].cause) == (None, "backward", None)
    assert "outside blocks.2" in by_step[4].detail
    # step 5: the hooks watch the whole model again and name the module
    assert (by_step[5].module, by_step[5].phase) == ("blocks.4.mlp", "backward")


def test_a_replay_leaves_no_flag_for_the_next_step():
    model = lm()
    # the blocks named (the last one summed too: a non-finite loss with every output finite names nothing)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": top_blocks(model)})
    faults.inject(opt, faults.output("blocks.1", "nan", steps=[2]),  # fires on step 2 and on its replay
                  faults.loss("nan", steps=[3]))  # step 3: only the loss; no block output is non-finite
    train_lm(opt, model, batches(4), closure=True)
    by_step = {a.step: a for a in opt.anomalies}
    assert (by_step[2].module, by_step[2].phase) == ("blocks.1", "forward")
    assert "Sentinel" not in by_step[3].detail and by_step[3].module is None


class Sums(TorchDispatchMode):
    """The shapes of the tensors summed (``aten.sum``) or read by a batched ``_foreach_norm`` while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.batches: list[int] = []  # each _foreach_norm's tensor count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.sum:
            self.shapes.append(tuple(args[0].shape))
        elif func.overloadpacket is torch.ops.aten._foreach_norm:
            self.shapes.extend(tuple(t.shape) for t in args[0])
            self.batches.append(len(args[0]))
        return func(*args, **(kwargs or {}))


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                                                n_head=2))


def test_the_models_output_is_read_through_the_loss():
    # GPT-2's logits (the last block's output, the model's output) are most of what the sentinel cost on a real
    # model (benchmarks/RESULTS.md, stop 61): summed on the first step, where the guard learns that they are the
    # model's output and that it is given the loss; read through the loss after that. Every other block is summed on
    # every step. Before: the logits summed on every step.
    model = gpt2()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    g = torch.Generator().manual_seed(1)
    logits, hidden, summed = (4, 16, 64), (4, 16, 32), []
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        with Sums() as sums, opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        summed.append(sums.shapes)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert summed[0].count(logits) == 1
    assert summed[1].count(logits) == summed[2].count(logits) == 0
    assert all(s.count(hidden) >= 3 for s in summed)  # wte's, each h.k's and ln_f's outputs: still summed
    assert all(not r.skipped for r in opt.history)


def test_an_overflow_in_the_head_is_named_on_its_step_through_the_loss():
    # a genuine fp16 overflow in Llama's (untied) lm_head: its weight scaled so that the largest logit passes
    # 65504 (the weight itself stays finite in fp16); the loss, computed from the logits in fp32, is NaN
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, scaler=scaler,
                        config={"sentinel": "top"})
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        if step == 2:
            with torch.no_grad():
                peak = model(input_ids=ids).logits.float().abs().max().item()
                model.lm_head.weight.mul_(2 * 65504 / peak)
                assert model.lm_head.weight.half().isfinite().all()
        with opt.autocast():
            out = model(input_ids=ids, labels=ids)
        if step == 2:
            assert not out.logits.isfinite().all() and out.logits.dtype == torch.float16
        opt.backward(out.loss)
        opt.step()
        opt.zero_grad()
        if step == 2:
            with torch.no_grad():
                model.lm_head.weight.mul_(peak / (2 * 65504))
    (a, *_) = [a for a in opt.anomalies if a.step == 2]
    assert (a.kind, a.module, a.phase) == ("nonfinite_loss", "lm_head", "forward"), a
    assert "or the loss computed from its output" in a.detail and "model.norm" not in a.detail
    assert [r.skipped for r in opt.history] == [False, False, True, False]


def test_a_nonfinite_loss_alone_is_named_as_the_last_block_or_the_loss():
    # "top" reads the model's output through the loss: a loss non-finite on its own (every block's output finite)
    # cannot be told from the head's, and is named as either (a sentinel given the blocks by name sums the last one:
    # test_a_replay_leaves_no_flag_for_the_next_step)
    model = lm()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    faults.inject(opt, faults.loss("nan", steps=[3]))
    train(opt, model, batches(4))
    (a,) = opt.anomalies
    assert (a.step, a.module, a.phase) == (3, "head", "forward")
    assert "head, the model's last block, or the loss computed from its output" in a.detail


def test_a_head_whose_output_is_not_the_models_is_summed_on_every_step():
    class Doubled(torch.nn.Module):  # the model's output is made from the head's: nothing reads the head's but this
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 16)
            self.head = torch.nn.Sequential(torch.nn.Linear(16, 4))

        def forward(self, x):
            return self.head(torch.tanh(self.body(x))) * 2

    torch.manual_seed(0)
    model = Doubled()
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        config={"sentinel": "top"})
    faults.inject(opt, faults.output("head.0", "nan", steps=[2]))
    for _ in range(3):
        with Sums() as sums, opt.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        assert (4, 4) in sums.shapes  # the head's output: summed (when the model's forward returned)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    (a,) = opt.anomalies
    assert (a.step, a.module) == (2, "head") and "first watched block whose output was non-finite" in a.detail


def test_a_last_block_called_twice_has_its_first_output_summed():
    class Twice(torch.nn.Module):  # the head applied twice: only its second output is the model's
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 16)
            self.head = torch.nn.Sequential(torch.nn.Linear(16, 16))

        def forward(self, x):
            return self.head(torch.tanh(self.head(self.body(x))))

    torch.manual_seed(0)
    model = Twice()
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        config={"sentinel": "top"})
    faults.inject(opt, faults.output("head.0", "nan", steps=[2]))
    heads = []
    for _ in range(3):
        with Sums() as sums, opt.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        heads.append(sums.shapes.count((4, 16)))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    # step 0: both outputs summed (and body's); then the first call's only: the second is the model's output.
    # Before: neither, from step 1, and the NaN of step 2 was named as "the last block, or the loss"
    assert heads == [3, 2, 2]
    (a,) = opt.anomalies
    assert (a.step, a.module) == (2, "head") and "first watched block whose output was non-finite" in a.detail


def test_under_torch_compile_the_sums_are_in_the_graph_and_a_genuine_overflow_is_named(compile_state):
    # A compiled Hugging Face GPT-2 with sentinel="top", fp16 with a GradScaler. The hooks trace into the model's one
    # graph (dynamo's FX graph, recorded by a backend that runs it as traced): no graph break. The guard learns on
    # step 0 that the logits are the model's output; the one recompile that follows (on the guard's loss_given)
    # drops their sum from the graph. A genuine fp16 overflow in transformer.h.1's MLP (c_fc's weight scaled so that
    # its output passes 65504) is named on its step. Until stop 62 the sentinel had not been run under compile.
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, loss_type="ForCausalLM"))
    graphs: list[torch.fx.GraphModule] = []

    def recorded(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=recorded)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=compiled,
                        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8), config={"sentinel": "top"})
    g = torch.Generator().manual_seed(1)
    fc, summed = model.transformer.h[1].mlp.c_fc, []
    try:
        for step in range(5):
            ids = torch.randint(0, 64, (4, 16), generator=g)
            before = len(graphs)
            if step == 3:
                with torch.no_grad():
                    peak = fc(model.transformer.h[1].ln_2(model.transformer.wte(ids))).abs().max().item()
                    fc.weight.mul_(4 * 65504 / peak)
                    assert fc.weight.half().isfinite().all()
            with opt.autocast():
                out = compiled(input_ids=ids)
            loss = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, 64), ids.reshape(-1))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            if step == 3:
                with torch.no_grad():
                    fc.weight.mul_(peak / (4 * 65504))
            summed.append([[tuple(n.args[0].meta["example_value"].shape) for n in gm.graph.nodes
                            if n.op == "call_function" and n.target is torch.sum] for gm in graphs[before:]])
        opt.flush()
        # step 0: one graph, with every top block's sum (wte, wpe, h.0, h.1, ln_f, and lm_head's logits); step 1: the
        # one recompile, the logits read through the loss; steps 2-4 reuse it (3 and 4: the armed hooks run eagerly)
        assert [len(s) for s in summed] == [1, 1, 0, 0, 0]
        assert summed[0][0].count((4, 16, 64)) == 1 and len(summed[0][0]) == 7
        assert summed[1][0].count((4, 16, 64)) == 0 and len(summed[1][0]) == 6
        (a, *_) = [a for a in opt.anomalies if a.step == 3]
        assert (a.kind, a.module, a.phase) == ("nonfinite_loss", "transformer.h.1", "forward"), a
        assert [r.skipped for r in opt.history] == [False, False, False, True, False]
    finally:
        opt.close()


@contextlib.contextmanager
def copies_of(shape: tuple[int, ...], counted: list[int]) -> Iterator[None]:
    """Appends to ``counted`` how many ``aten::_to_copy`` of a tensor of ``shape`` the block made, nested ones included
    (a TorchDispatchMode sees the ops it is handed, not those a kernel calls inside: the profiler sees both)."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        yield
    counted.append(sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                       and tuple(e.input_shapes[0]) == shape))


def test_a_bf16_model_on_the_cpu_is_summed_without_a_float32_copy_of_each_output():
    # stop 64: on the CPU, torch.sum(dtype=float32) of a bf16 tensor copies it whole to float32 first (8x1024x768:
    # 3.0 ms against 0.56 for the bf16 sum, which accumulates in float32 too: cpu_stop64/sentinel_cpu_sum.out); CUDA
    # reads it as it is. A GPT-2 in bf16 (its residual stream bf16: under autocast alone it stays float32), the same
    # steps with and without the sentinel: it adds no float32 copy of a hidden state (before: 5 a forward, one per
    # summed output). Then what the bf16 sum flags, on bf16 values as a block would output them
    copies = []
    for sentinel in (None, "top"):
        model = gpt2().to(torch.bfloat16)
        opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=1e-3), model=model, precision="bf16",
                            config={"sentinel": sentinel})
        g = torch.Generator().manual_seed(1)
        seen = []
        for _ in range(3):
            ids = torch.randint(0, 64, (4, 16), generator=g)
            with copies_of((4, 16, 32), seen):
                loss = model(input_ids=ids, labels=ids).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        copies.append(seen)
        opt.close()
    assert copies[1] == copies[0], copies
    # what the bf16 sum flags: NaN, inf, -inf and inf with -inf, not large finite values whose float32 sum is finite
    sentinel = Sentinel(gpt2(), "top", torch.device("cpu"))
    big = torch.full((4, 16, 32), 1e34, dtype=torch.bfloat16)  # 2048 x 1e34: 2e37, past bf16's sums' own range
    for value, flagged in ((None, False), (float("nan"), True), (float("inf"), True), (float("-inf"), True)):
        x = big.clone()
        if value is not None:
            x[0, 0, 0] = value
        if value == float("inf"):
            x[1, 0, 0] = -value  # inf - inf: NaN
        sentinel._mark(2, x)
        code = sentinel.value().item()
        assert (code == 2) is flagged, (value, code)
    sentinel.remove()


def test_a_genuine_nan_in_a_block_is_named_on_its_step():
    # a LayerNorm with eps=0 over a constant row divides 0 by 0: a genuine NaN in block "1"'s output (block "0", a
    # ReLU, turns a negative row into zeros first: its own output stays finite)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.LayerNorm(8, eps=0.0, elementwise_affine=False),
                                torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    for step in range(4):
        x = torch.randn(6, 8)
        if step == 2:
            x[3] = -1.0  # after the ReLU, a row of zeros
        with opt.autocast():
            loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.flush()
    (a, *_) = [a for a in opt.anomalies if a.step == 2]
    assert (a.module, a.phase) == ("1", "forward") and "Sentinel" in a.detail, a
    assert [r.skipped for r in opt.history] == [False, False, True, False]
    opt.close()


def test_batched_reads_are_one_foreach_norm_per_dtype_a_forward(read_mode):
    # AMPGUARD_SENTINEL_BATCH (stop 65): an H100's profile put 178 of the sentinel's 183 us a step in 15 single sums
    # (and 15 memsets); batched, the outputs are read together when the model returns, one _foreach_norm per dtype,
    # and no block output is summed on its own. A GPT-2 under bf16 autocast: its embeddings and residual stream
    # float32 (wte, wpe, drop, h.0, h.1, ln_f: 6 outputs), the logits read through the loss from step 1
    model = gpt2()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        with Sums() as sums, opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        seen.append((sums.batches, [shape for shape in sums.shapes if shape[:2] == (4, 16)]))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.close()
    if read_mode == "batched":
        assert seen[0][0] == [6, 1], seen[0]  # float32: the six; the logits (bf16) on step 0 alone
        assert all(batches == [6] for batches, _ in seen[1:]), seen
        assert all(sorted(shapes)[:5] == [(4, 16, 32)] * 5 for _, shapes in seen[1:]), seen  # wpe's is (1, 16, 32)
    else:
        assert all(batches == [] for batches, _ in seen), seen


def test_a_checkpointed_blocks_recompute_holds_nothing_past_the_backward(read_mode):
    # Reentrant activation checkpointing runs each block's forward under no_grad, then again inside the backward with
    # grad on, where the model's own forward hook never runs: batched, the recomputed outputs were held until the
    # step's read (stop 65, fails before: 3 held after each backward), keeping alive the activations checkpointing
    # exists to free. An output made inside a backward is summed as it comes, and the block is named on its step
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                              for _ in range(3))
            self.head = torch.nn.Linear(16, 1)

        def forward(self, x):
            x = self.emb(x)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            return self.head(x)

    torch.manual_seed(0)
    model = Checkpointed()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, precision="bf16",
                        config={"sentinel": "top"})
    sentinel = opt._forensics.sentinel
    weight = model.blocks[1][0].weight
    held = []
    for step in range(4):
        if step == 2:  # a bit flipped through an integer view: one weight of blocks.1 becomes NaN, so does its output
            kept = weight.detach().clone()
            with torch.no_grad():
                weight.view(torch.int32)[0, 0] |= 0x7FC00000
        with opt.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        opt.backward(loss)
        held.append(len(sentinel._pending))
        if step == 2:
            with torch.no_grad():
                weight.copy_(kept)
        opt.step()
        opt.zero_grad()
    opt.flush()
    assert held == [0, 0, 0, 0], held
    (a, *_) = [a for a in opt.anomalies if a.step == 2]
    assert a.module == "blocks.1", a
    assert [r.skipped for r in opt.history] == [False, False, True, False]
    opt.close()


def test_the_steps_value_takes_seven_ops():
    # stop 65: each op of Sentinel.value() is a kernel launched from the host on every step (outside the step graph);
    # torch.isfinite took four of them twice (12 ops in all, before). (x - x) == 0 is isfinite in two, and the first
    # flagged code is compared with inf once: 7. The values are the same: -1 for none, the first flagged slot
    sentinel = Sentinel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), ["0", "1"],
                        torch.device("cpu"))
    for marks, want in (([], -1.0), ([(1, 1.0)], -1.0), ([(1, 1.0), (2, float("nan"))], 2.0),
                        ([(2, float("inf")), (1, float("-inf"))], 1.0), ([(0, float("nan")), (2, 1.0)], 0.0)):
        for slot, value in marks:
            sentinel._mark(slot, torch.full((3,), value))
        sentinel.flush()  # batched: read when the model returns, which this test does not call
        with _Ops() as ops:  # the kernels (views and allocations left out)
            got = sentinel.value()
        assert got.item() == want, (marks, got)
        assert len(ops.seq) == (7 if marks else 0), ops.seq
    sentinel.remove()
