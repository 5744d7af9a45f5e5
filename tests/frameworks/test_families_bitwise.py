"""The guarded loop is the plain GradScaler loop, bit for bit, on the six Hugging Face model families
(``benchmarks/hf_classification.py``'s builders: GPT-2, Llama, Mistral, Qwen2, BERT, T5 at tiny sizes, from their
``transformers`` config classes; no weights downloaded): fused, foreach and for-loop AdamW, SGD with momentum, two
micro-batches a step, sampled numerics and indicators and the sentinel (read only: no bit changes), and bf16 without
loss scaling; clipping by norm against the plain loop's unscale_ and clip_grad_norm_; torch's several-optimizers
recipe on one GradScaler (a guard on each, the scale shared: each guard updating the scale alone fails every family);
a checkpoint saved mid-run and loaded into fresh objects, which resumes the run bit for bit (the scaler left
unrestored fails 10 of the 12); and the parameter check on a real eps=0 NaN in each family.

fp16 autocast on the CPU, ``GradScaler("cpu", init_scale=2**18, growth_interval=2)``: the fp16 backward overflows as
it comes (nothing injected) within the first two steps, the scale backs off to where steps are taken, grows after two
taken steps and overflows again (2**16-2**18 on every family). Held against the plain loop,
``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, on a twin model and the same batches: every
step's loss scale and ``.grad`` after the step, and at the end every parameter and every optimizer state tensor. On
the CPU these run the guard's host paths: the fused fast path (the still-scaled gradients measured, the kernel
unscales) and, for foreach, norms first with each gradient unscaled right after its dot (``stats.cpu_norms``'s
``unscale_by``, stop 67) and GradScaler's own element check on a non-finite step; and, with the host decision off
(``tensor-decision``), the decision as it is taken off the CPU, in tensors (eagerly: the CPU captures no graph).
Taking out ``check_unscaled`` (stop 67's fix) fails every case with a non-fused optimizer (30 of the 60).
"""

from __future__ import annotations

import io
import itertools
import math
from pathlib import Path

import pytest
import torch

import ampguard

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
FAMILY_NAMES = ["gpt2", "llama", "mistral", "qwen2", "bert", "t5"]


@pytest.fixture(scope="module")
def families(hf_bench):
    return hf_bench.FAMILIES


OPTIMIZERS = {
    "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


def _run(build, optim: str, guarded: bool, host: bool = True, accumulate: int = 1, precision: str = "fp16",
         **config: object):
    torch.manual_seed(0)
    model, _ = build(False)
    model.train()
    opt = OPTIMIZERS[optim](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2) if precision == "fp16" else None
    if guarded:
        opt = ampguard.wrap(opt, model=model, precision=precision, scaler=scaler, exporters=[],
                            config=ampguard.GuardConfig(**config))
        opt._pipeline.host_decision = host  # False: the tensor decision, the path off the CPU (run eagerly here)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    scales, grads = [], []
    for _ in range(STEPS):
        for _ in range(accumulate):  # micro-batches, each loss divided as the accumulation recipes divide it
            ids = torch.randint(2, vocab, (2, 8), generator=g)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(input_ids=ids, labels=ids).loss / accumulate
            if guarded:
                opt.backward(loss)
            else:
                (loss if scaler is None else scaler.scale(loss)).backward()
        scales.append(None if scaler is None else scaler.get_scale())
        if guarded or scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.zero_grad(set_to_none=True)
    scales.append(None if scaler is None else scaler.get_scale())
    reports = list(opt.history) if guarded else None
    state = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    inner = opt.optimizer if guarded else opt
    for i, st in enumerate(inner.state.values()):
        state.update({f"s.{i}.{k}": v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    if guarded:
        opt.close()
    return scales, grads, state, reports


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads included (``torch.equal`` says two NaNs differ: a skipped step's gradients hold
    them)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _assert_same(got, want) -> None:
    """Two runs of :func:`_run`: the same loss scales, ``.grad`` after every step, parameters and optimizer state."""
    got_scales, got_grads, got_state, _ = got
    want_scales, want_grads, want_state, _ = want
    assert got_scales == want_scales
    for step, (g_step, w_step) in enumerate(zip(got_grads, want_grads)):
        assert g_step.keys() == w_step.keys()
        for name in w_step:
            g, w = g_step[name], w_step[name]
            assert (g is None) == (w is None), (step, name)
            assert g is None or _same_bits(g, w), f"step {step}: {name}.grad differs"
    assert got_state.keys() == want_state.keys()
    for name in want_state:
        assert _same_bits(got_state[name], want_state[name]), f"{name} differs"


def _overflowed_and_grew(run) -> None:
    """The fp16 run is what it says: real overflows skipped (the scale backed off), steps taken, and growth."""
    scales, _, _, reports = run
    skipped = [r.skipped for r in reports]
    assert any(skipped) and not all(skipped), skipped
    pairs = list(itertools.pairwise(scales))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), scales


def _as_the_plain_loop(build, optim: str, *, host: bool = True, accumulate: int = 1, **config: object):
    """The guarded fp16 run (:func:`_run`, ``config`` its GuardConfig), through real overflows and growth, held bit for
    bit against the plain loop on the same micro-batches. Returns the guarded run."""
    got = _run(build, optim, guarded=True, host=host, accumulate=accumulate, **config)
    _overflowed_and_grew(got)
    _assert_same(got, _run(build, optim, guarded=False, accumulate=accumulate))
    return got


@pytest.mark.parametrize("host", [True, False], ids=["host-decision", "tensor-decision"])
@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_guarded_loop_is_the_plain_loop_bit_for_bit(families, family, optim, host):
    _as_the_plain_loop(families[family], optim, host=host)


@pytest.mark.parametrize(("optim", "accumulate"), [("forloop", 1), ("sgd", 1), ("fused", 2), ("foreach", 2)],
                         ids=["adamw-forloop", "sgd-momentum-foreach", "fused-accumulate-2", "foreach-accumulate-2"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_other_optimizers_and_accumulation_are_the_plain_loop_bit_for_bit(families, family, optim, accumulate):
    # AdamW's for-loop step (GradScaler's found_inf read, then the step), SGD with momentum; two micro-batches a step,
    # each loss divided by two (opt.backward twice, then opt.step; the plain loop's scaler.scale(loss).backward twice)
    _as_the_plain_loop(families[family], optim, accumulate=accumulate)


@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sampled_numerics_and_indicators_change_no_bit(families, family, optim):
    # numerics_every=2 (each other step's zero fraction and headroom, read from the still-scaled gradients: on such a
    # step the foreach path unscales after its norms, not as it goes) and indicators_every=3 (the weights copied
    # before the update, module norms and update ratios after it): read only, the plain loop's bits
    reports = _as_the_plain_loop(families[family], optim, numerics_every=2, indicators_every=3)[3]
    assert [r.grad_zero_fraction is not None for r in reports] == [r.step % 2 == 0 for r in reports]
    assert any(r.module_update_ratios for r in reports if r.step % 3 == 0)  # a taken sampled step's ratios


@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_sentinel_changes_no_bit(families, family, optim):
    # sentinel="top": a forward hook on each top block reads its output every step (and the model's own output
    # through the loss); the run's bits stay the plain loop's
    _as_the_plain_loop(families[family], optim, sentinel="top")


@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_without_loss_scaling_is_the_plain_loop_bit_for_bit(families, family, optim):
    # bf16 autocast, no GradScaler: the guard measures and decides, and every step is taken as in loss.backward();
    # opt.step()
    got = _run(families[family], optim, guarded=True, precision="bf16")
    assert not any(r.skipped for r in got[3])
    _assert_same(got, _run(families[family], optim, guarded=False, precision="bf16"))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_adamw_eps0_on_rows_no_batch_reaches_is_caught_and_named(families, family, precision):
    # a real 0/0: AdamW with eps=0 divides exp_avg by sqrt(exp_avg_sq) + 0, both exactly 0 where a gradient is 0.
    # Each family has its own such parameters: embedding and position rows the batch never reads (GPT-2's wpe,
    # Llama's embed_tokens, BERT's position and token-type embeddings), BERT's attention key bias (softmax does not
    # see a shift), T5's relative-position buckets no pair falls in and its ReLU units dead on this batch. They turn
    # NaN on the first update from finite gradients; the default parameter check (every 10th step, step 0 among
    # them) names exactly them on that step and stops the run.
    torch.manual_seed(0)
    model, _ = families[family](False)
    model.train()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=0.0, fused=True)
    opt = ampguard.wrap(inner, model=model, precision=precision, exporters=[])
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ampguard.NonFiniteError):
        for _ in range(3):
            ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(input_ids=ids, labels=ids).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
    poisoned = tuple(n for n, p in model.named_parameters() if not torch.isfinite(p).all())
    assert poisoned
    (anomaly,) = [a for a in opt.anomalies if a.kind == "nonfinite_params"]
    assert anomaly.step == 0 and set(anomaly.params) == set(poisoned), (anomaly.params, poisoned)
    opt.close()


def _clipped(build, optim: str, guarded: bool, clip: float = 0.5):
    """Eight fp16 steps through real overflows and growth, clipped by norm: ``opt.clip_grad_norm_`` on the guard, the
    plain loop's ``scaler.unscale_(opt)`` + ``torch.nn.utils.clip_grad_norm_``. The loss scales, the norms returned,
    the parameters after each step."""
    torch.manual_seed(0)
    model, _ = build(False)
    model.train()
    opt = OPTIMIZERS[optim](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2)
    if guarded:
        opt = ampguard.wrap(opt, model=model, precision="fp16", scaler=scaler, exporters=[])
    g = torch.Generator().manual_seed(1)
    scales, norms, params = [], [], []
    for _ in range(STEPS):
        ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scales.append(scaler.get_scale())
        if guarded:
            opt.backward(loss)
            norms.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    scales.append(scaler.get_scale())
    if guarded:
        opt.close()
    return scales, norms, params


@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_clipping_takes_the_plain_loops_decisions_and_its_clip(families, family, optim):
    want_scales, want_norms, want_params = _clipped(families[family], optim, guarded=False)
    got_scales, got_norms, got_params = _clipped(families[family], optim, guarded=True)
    # the same decisions: which steps overflow (a non-finite norm), and the loss scale after each
    assert got_scales == want_scales
    assert any(b < a for a, b in itertools.pairwise(want_scales)), want_scales  # real overflows among the steps
    taken = [math.isfinite(n) for n in want_norms]
    assert [math.isfinite(n) for n in got_norms] == taken and any(taken), (got_norms, want_norms)
    assert min(n for n in want_norms if math.isfinite(n)) > 0.5  # the clip bites on every taken step
    if optim == "foreach":  # unscaled first, then clipped by clip_grad_norm_'s coefficient: its bits
        assert got_norms[taken.index(True)] == want_norms[taken.index(True)]
        for name, want in want_params[-1].items():
            assert _same_bits(got_params[-1][name], want), name
        return
    # Fused: the clip folded into the kernel's grad_scale (scale / coefficient: one rounding where the plain loop's
    # unscale and clip make two), so the first taken step agrees to float32 rounding. Later steps drift further:
    # Adam turns a gradient at rounding level (a key projection's bias, which softmax does not see) into a full
    # +-lr update, so one rounding apart there is an lr apart after the step (up to 5e-5 in the norms by step 6).
    first = taken.index(True)
    assert got_norms[first] == pytest.approx(want_norms[first], rel=2e-7)
    for name, want in want_params[first].items():
        torch.testing.assert_close(got_params[first][name], want, rtol=1e-5, atol=1e-8)
    for got, want in zip(got_norms, want_norms):
        assert not math.isfinite(want) or got == pytest.approx(want, rel=1e-3)


def _shared(build, guarded: bool):
    """torch's several-optimizers recipe on one GradScaler: the model's parameters split in two (the first half with
    a fused AdamW, the rest with a foreach one), ``scaler.scale(loss).backward(); scaler.step(opt0);
    scaler.step(opt1); scaler.update()``; guarded: one guard on each optimizer, the scaler shared, each guard's
    ``step()`` (each given the loss by ``observe_loss``). The loss scales and the parameters after each step."""
    torch.manual_seed(0)
    model, _ = build(False)
    model.train()
    params = list(model.parameters())
    half = len(params) // 2
    opts = [OPTIMIZERS["fused"](params[:half]), OPTIMIZERS["foreach"](params[half:])]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2)
    if guarded:
        opts = [ampguard.wrap(opts[0], model=model, precision="fp16", scaler=scaler, exporters=[]),
                ampguard.wrap(opts[1], precision="fp16", scaler=scaler, exporters=[])]
    g = torch.Generator().manual_seed(1)
    scales, after = [], []
    for _ in range(STEPS):
        ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scales.append(scaler.get_scale())
        for opt in opts if guarded else ():
            opt.observe_loss(loss)  # the loss each guard reports (the backward is the scaler's, not a guard's)
        scaler.scale(loss).backward()
        for opt in opts:
            opt.step() if guarded else scaler.step(opt)
        if not guarded:
            scaler.update()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        after.append([p.detach().clone() for p in params])
    scales.append(scaler.get_scale())
    for opt in opts if guarded else ():
        opt.close()
    return scales, after


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_guards_on_one_scaler_are_torchs_multi_optimizer_loop(families, family):
    want_scales, want_after = _shared(families[family], guarded=False)
    got_scales, got_after = _shared(families[family], guarded=True)
    pairs = list(itertools.pairwise(want_scales))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), want_scales
    assert got_scales == want_scales
    for step, (got, want) in enumerate(zip(got_after, want_after)):
        for i, (g, w) in enumerate(zip(got, want)):
            assert _same_bits(g, w), f"step {step}: parameter {i} differs"


def _resumed(build, optim: str, stop_at: int | None):
    """Eight guarded fp16 steps (through overflows and growth); with ``stop_at``, saved after that many as README's
    recipe saves (``torch.save({"model": model.state_dict(), "opt": opt.state_dict()})``, with torch's RNG state),
    then loaded into a fresh model, optimizer, scaler and guard that run the rest. The loss scales, the skips and the
    parameters at the end."""
    def fresh():
        torch.manual_seed(0)
        model, _ = build(False)
        model.train()
        opt = ampguard.wrap(OPTIMIZERS[optim](model.parameters()), model=model, precision="fp16",
                            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2), exporters=[])
        return model, opt

    model, opt = fresh()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(2, model.config.vocab_size, (2, 8), generator=g) for _ in range(STEPS)]
    scales, skipped = [], []
    for i, ids in enumerate(batches):
        if i == stop_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, buf)
            skipped += [r.skipped for r in opt.history]
            opt.close()
            model, opt = fresh()
            buf.seek(0)
            saved = torch.load(buf)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            torch.set_rng_state(saved["rng"])  # GPT-2's, BERT's and T5's dropout draw from it, as resume recipes keep
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        scales.append(opt.get_scale())
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    skipped += [r.skipped for r in opt.history]
    opt.close()
    return scales, skipped, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("optim", ["fused", "foreach"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_checkpoint_resumes_the_run_bit_for_bit(families, family, optim):
    # saved after step 3 (the scale already backed off and grown on every family), loaded into fresh objects
    want_scales, want_skipped, want_params = _resumed(families[family], optim, None)
    got_scales, got_skipped, got_params = _resumed(families[family], optim, 3)
    assert any(want_skipped) and not all(want_skipped), want_skipped
    assert (got_scales, got_skipped) == (want_scales, want_skipped)
    for name, want in want_params.items():
        assert _same_bits(got_params[name], want), name
