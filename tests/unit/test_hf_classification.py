"""The classic fp16 attention overflow on real Hugging Face model families: the attention module,
phase ``forward``, cause ``overflow``, on the step ``docs/diagnosis.md`` states.

Each family is built from its ``transformers`` config class (tiny: 2 layers, hidden 32, sequence
8, eager attention) and trained in fp16 (autocast, ``GradScaler("cpu")``). Before step 1 the
query/key projections of layer 1 are multiplied in place: a lasting state of the model, from which
``q @ kᵀ`` leaves fp16's range on every forward; nothing is injected. The scenario is
``benchmarks/hf_classification.py``, which runs the same on CUDA (and GPT-2 at 124M).

The replay (``opt.step(closure, replay=True)``) and the sentinel (``sentinel="top"``) run on all six families since
stop 68 (GPT-2 and Llama, and GPT-2 alone, before): each names the block, then the attention, on every family.

Before the recompute ran on copies of its stateful arguments, the attention's saved call held the
forward's live KV cache (``DynamicCache``, T5's ``EncoderDecoderCache``): each recompute appended
to it and failed on a shape mismatch, so the cause was None on every step for GPT-2, Llama,
Mistral, Qwen2 and T5's decoder, and the run's own cache grew. And the first bad step, seen by no
hook, was reported as phase ``loss``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("hf_classification_bench", REPO / "benchmarks" /
                                                  "hf_classification.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


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
