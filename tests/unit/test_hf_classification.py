"""The classic fp16 attention overflow on real Hugging Face model families: the attention module,
phase ``forward``, cause ``overflow``, on the step ``docs/diagnosis.md`` states.

Each family is built from its ``transformers`` config class (tiny: 2 layers, hidden 32, sequence
8, eager attention) and trained in fp16 (autocast, ``GradScaler("cpu")``). Before step 1 the
query/key projections of layer 1 are multiplied in place: a lasting state of the model, from which
``q @ kᵀ`` leaves fp16's range on every forward; nothing is injected. The scenario is
``benchmarks/hf_classification.py``, which runs the same on CUDA (and GPT-2 at 124M).

The replay (``opt.step(closure, replay=True)``) and the sentinel (``sentinel="top"``) run on all six families since
stop 68 (GPT-2 and Llama, and GPT-2 alone, before): each names the block, then the attention, on every family.

A lasting overflow (the q/k grown, every later forward overflowing) stops the run, at ``max_consecutive_skips`` or
by the ladder; until stop 68 its advice told the user to check the batch and the loss for a log of 0 while forensics
had named the attention's forward overflow. It now speaks about that module (``ampguard.logs.advice_for``).

Before the recompute ran on copies of its stateful arguments, the attention's saved call held the
forward's live KV cache (``DynamicCache``, T5's ``EncoderDecoderCache``): each recompute appended
to it and failed on a shape mismatch, so the cause was None on every step for GPT-2, Llama,
Mistral, Qwen2 and T5's decoder, and the run's own cache grew. And the first bad step, seen by no
hook, was reported as phase ``loss``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ._models import hf_steps

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(hf_bench):
    return hf_bench


def _named(step: dict) -> tuple:
    return step["module"], step["phase"], step["cause"]


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "bert", "t5"])
def test_attention_overflow_is_named_with_its_cause(bench, family):
    r = bench.run(family, steps=3)
    assert r["skipped"] == [1, 2]  # healthy before the q/k growth, overflowing on every step after it
    # The first bad step: no hook was armed, nothing was seen: nothing is claimed (it said "loss").
    assert _named(r["steps"][1]) == (None, None, None), r["steps"][1]
    # The next step (no closure, CPU): the attention module, by recompute in fp16 and fp32.
    assert _named(r["steps"][2]) == (r["attention"], "forward", "overflow"), r["steps"][2]["detail"]
    assert "non-finite in float16 autocast and finite in fp32" in r["steps"][2]["detail"]


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "bert", "t5"])
def test_attention_overflow_under_replay_is_named_on_the_first_bad_step(bench, family):
    r = bench.run(family, variant="replay", steps=2)
    assert r["skipped"] == [1]
    assert _named(r["steps"][1]) == (r["attention"], "forward", "overflow"), r["steps"][1]["detail"]
    assert "persistent" in r["steps"][1]["detail"]


BLOCKS = {"gpt2": "transformer.h.1", "llama": "model.layers.1", "mistral": "model.layers.1", "qwen2": "model.layers.1",
          "bert": "bert.encoder.layer.1", "t5": "decoder.block.1"}
"""The top block (``sentinel="top"``) that holds each family's growing attention."""


@pytest.mark.parametrize("family", list(BLOCKS))
def test_attention_overflow_with_the_sentinel_names_the_block_then_the_attention(bench, family):
    r = bench.run(family, variant="sentinel", steps=3)
    assert r["attention"].startswith(BLOCKS[family] + ".")
    assert _named(r["steps"][1]) == (BLOCKS[family], "forward", None)
    assert _named(r["steps"][2]) == (r["attention"], "forward", "overflow"), r["steps"][2]["detail"]


def test_the_recompute_leaves_the_runs_kv_cache_as_it_was(bench):
    # GPT-2 returns the DynamicCache its forward filled; on step 2 the attention is recomputed
    # twice. Before: each recompute appended to that cache (8 -> 16 -> 24 positions).
    r = bench.run("gpt2", steps=3, keep_cache=True)
    assert _named(r["steps"][2])[2] == "overflow"
    before, after = r["caches"][2]
    assert len(before) == len(after) == 2
    for b, a in zip(before, after):
        assert a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())


def _lasting_overflow(bench, family: str, config):
    """``family`` trained in fp16 with the q/k grown before step 1, so that every later forward overflows in the
    attention, until the guard stops the run: (the attention's name, the ``NonFiniteError``)."""
    import ampguard

    torch.manual_seed(0)
    model, attention = bench.FAMILIES[family](False)
    model.train()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"), exporters=[], config=config)
    with pytest.raises(ampguard.NonFiniteError) as err:
        hf_steps(opt, model, 30, lambda step: bench.grow_qk(model, attention) if step == 1 else None)
    opt.close()
    return attention, err.value


def _advice(err: Exception) -> str:
    return str(err).split("What to do: ")[1].split(". Last report")[0]


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "bert", "t5"])
def test_a_lasting_attention_overflow_stops_the_run_with_advice_about_that_attention(bench, family, caplog):
    # After the q/k growth every forward overflows fp16 in the attention; the loss is non-finite whatever the loss
    # scale (the forward runs before the scale multiplies the loss), so the scale backs off for nothing and the run
    # stops at max_consecutive_skips. Its advice named the loss and the batch (a log of 0, labels out of range) while
    # forensics had localised a forward overflow in the attention: it must speak about that module.
    import ampguard

    with caplog.at_level("WARNING", logger="ampguard"):
        attention, err = _lasting_overflow(bench, family, ampguard.GuardConfig(max_consecutive_skips=8))
    advice = _advice(err)
    assert f"module {attention}'s forward overflows" in advice and "bf16" in advice, advice
    assert "check this batch" not in advice and "labels out of range" not in advice, advice
    # the half-way warning and the finding's own message say the same
    said = [r.getMessage() for r in caplog.records]
    halfway = next(m for m in said if "steps in a row skipped" in m)
    assert attention in halfway.split("What to do: ")[1], halfway
    finding = next(m for m in said if f"forensics found where the first non-finite value arose: module {attention}"
                   in m)
    assert "What to do: " in finding and "outside autocast" in finding, finding


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_the_ladders_stop_gives_the_same_advice(bench, family):
    # Escalation(rollback_after=4) with no snapshot yet (snapshot_every=50): the ladder aborts on the fourth
    # non-finite step; its diagnosis says what to do about the attention forensics localised
    import ampguard

    attention, err = _lasting_overflow(bench, family,
                                       ampguard.GuardConfig(escalation=ampguard.Escalation(rollback_after=4)))
    assert "no snapshot to roll back to" in str(err)
    advice = _advice(err)
    assert f"module {attention}'s forward overflows" in advice and "outside autocast" in advice, advice


def test_an_anomaly_localised_on_its_own_step_says_what_to_do_about_its_module(hf_bench, caplog):
    # opt.step(closure, replay=True) localises the first bad step itself: the non-finite loss's own message (the first
    # of its kind, so it is said) carries the advice about the attention; the finding's message after it does not
    # repeat it. Before: that message told the user to check the batch for a log of 0.
    import ampguard

    torch.manual_seed(0)
    model, attention = hf_bench.FAMILIES["gpt2"](False)
    model.train()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"), exporters=[])
    g = torch.Generator().manual_seed(1)
    with caplog.at_level("WARNING", logger="ampguard"):
        for step in range(2):
            if step == 1:
                hf_bench.grow_qk(model, attention)
            ids = torch.randint(2, model.config.vocab_size, (2, 8), generator=g)

            def closure(ids: torch.Tensor = ids) -> torch.Tensor:
                opt.zero_grad()
                with opt.autocast():
                    loss = model(input_ids=ids, labels=ids).loss
                opt.backward(loss)
                return loss

            opt.step(closure, replay=True)
        opt.flush()
    said = [r.getMessage() for r in caplog.records]
    (loss_message,) = [m for m in said if m.startswith("step 1, rank 0: nonfinite_loss")]
    advice = loss_message.split("What to do: ")[1]
    assert advice.startswith(f"module {attention}'s forward overflows") and "check this batch" not in advice, advice
    (finding,) = [m for m in said if "forensics found where" in m]
    assert f"module {attention}, phase forward, cause overflow" in finding and "What to do" not in finding, finding
    opt.close()


def test_a_backward_that_makes_nan_of_a_finite_gradient_is_advised_about_that_module(hf_bench, caplog):
    # A learning rate far too high (SGD, lr=50) on Llama: the first update grows the weights, and on step 3 layer 1's
    # backward turns a finite gradient into NaN. Its message advised "wrap(model=...) lets forensics name the module"
    # beside forensics' own naming of it; it now says what to do about that module's backward.
    import ampguard

    torch.manual_seed(0)
    model, _ = hf_bench.FAMILIES["llama"](False)
    model.train()
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=50.0), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu"), exporters=[])
    with caplog.at_level("WARNING", logger="ampguard"):
        hf_steps(opt, model, 4)
        opt.flush()
    (anomaly,) = [a for a in opt.anomalies if a.kind == "nonfinite_grad" and a.phase == "backward"]
    assert (anomaly.module, anomaly.cause) == ("model.layers.1", "nan")
    (message,) = [r.getMessage() for r in caplog.records if "nonfinite_grad" in r.getMessage()]
    advice = message.split("What to do: ")[1]
    assert advice.startswith("module model.layers.1's backward turned a finite incoming gradient into NaN/inf")
    assert "learning rate" in advice and "wrap(model=...)" not in advice, advice
    opt.close()
