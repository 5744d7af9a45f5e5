#!/usr/bin/env python
"""The classic fp16 attention overflow on real Hugging Face model families: what ampguard names.

Each family is built from its ``transformers`` config class with eager attention, trained with
fp16 autocast and a ``GradScaler``, and at step ``--bad-step`` the query and key projections of
one attention layer are multiplied (in place, a lasting state of the model, nothing injected)
until ``q @ kᵀ`` leaves fp16's range. The forward then overflows on every step. ampguard should
name that attention module, phase ``forward``, cause ``overflow``, on the step
``docs/diagnosis.md`` states (without a closure: the step after the first bad one; with
``opt.step(closure, replay=True)``: the first bad one; with ``sentinel="top"``: the block on the
first bad step, then the module). The first bad step's own anomaly, before any forensics hook
was armed, names nothing (module, phase and cause None).

Families (tiny by default: 2 layers, hidden 32, sequence 8; ``--gpt2-124m``: GPT-2 at its 124M
configuration, sequence 128):

    gpt2 (GPT2LMHeadModel)      transformer.h.1.attn                    cache: DynamicCache
    llama (LlamaForCausalLM)    model.layers.1.self_attn                cache: DynamicCache
    mistral (MistralForCausalLM) model.layers.1.self_attn               sliding-window cache layers
    qwen2 (Qwen2ForCausalLM)    model.layers.1.self_attn                q/k biases grown too
    bert (BertForMaskedLM)      bert.encoder.layer.1.attention.self     no cache (an encoder)
    t5 (T5ForConditionalGeneration) decoder.block.1.layer.0.SelfAttention  EncoderDecoderCache

    python benchmarks/hf_classification.py --out benchmarks/results/hf_classification_cpu.json
    python benchmarks/hf_classification.py --device cuda --gpt2-124m \
        --out benchmarks/results/hf_classification_h200.json

Writes JSON: per family and variant (``plain``, ``replay``, ``sentinel``) the module, phase and
cause named, the step named and the first bad step, and the step's detail. Used by
``tests/unit/test_hf_classification.py`` (the tiny CPU run). Needs transformers >= 5.17.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ampguard

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 64, 32, 2, 4, 8, 2
LAYER = 1
"""The attention layer whose q/k projections grow."""
GROWTH = 3000.0
"""The factor q and k projections are multiplied by: logits grow by its square (x 9e6), far past
fp16's 65504 at every size here, while q, k themselves and the fp32 logits stay in range."""
VARIANTS = ("plain", "replay", "sentinel")


def _config_kw() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "attn_implementation": "eager"}


def _decoder_kw() -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2, "max_position_embeddings": 64,
            **_config_kw()}


def _gpt2(big: bool) -> tuple[torch.nn.Module, str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = (GPT2Config(attn_implementation="eager") if big else
           GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64, bos_token_id=0, eos_token_id=0,
                      **_config_kw()))
    return GPT2LMHeadModel(cfg), f"transformer.h.{LAYER}.attn"


def _llama(big: bool) -> tuple[torch.nn.Module, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_decoder_kw())), f"model.layers.{LAYER}.self_attn"


def _mistral(big: bool) -> tuple[torch.nn.Module, str]:
    from transformers import MistralConfig, MistralForCausalLM

    return (MistralForCausalLM(MistralConfig(sliding_window=SEQ // 2, **_decoder_kw())),
            f"model.layers.{LAYER}.self_attn")


def _qwen2(big: bool) -> tuple[torch.nn.Module, str]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_decoder_kw())), f"model.layers.{LAYER}.self_attn"


def _bert(big: bool) -> tuple[torch.nn.Module, str]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, max_position_embeddings=64, **_config_kw())
    return BertForMaskedLM(cfg), f"bert.encoder.layer.{LAYER}.attention.self"


def _t5(big: bool) -> tuple[torch.nn.Module, str]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **_config_kw())
    return T5ForConditionalGeneration(cfg), f"decoder.block.{LAYER}.layer.0.SelfAttention"


FAMILIES: dict[str, Callable[[bool], tuple[torch.nn.Module, str]]] = {
    "gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "bert": _bert, "t5": _t5}
"""family -> builder(big) -> (model, the attention module whose q/k grow, as named)."""


@torch.no_grad()
def grow_qk(model: torch.nn.Module, attention: str, factor: float = GROWTH) -> list[str]:
    """Multiply the query and key projections of ``attention`` by ``factor`` in place (weights and
    biases; GPT-2's fused ``c_attn``: its q and k columns). Returns the parameters changed."""
    attn = model.get_submodule(attention)
    changed = []
    if hasattr(attn, "c_attn"):  # GPT-2's Conv1D: weight (in, 3 * hidden), columns q | k | v
        width = attn.c_attn.weight.shape[1] // 3
        attn.c_attn.weight[:, : 2 * width] *= factor
        attn.c_attn.bias[: 2 * width] *= factor
        return [f"{attention}.c_attn.weight", f"{attention}.c_attn.bias"]
    for name in ("q_proj", "k_proj", "query", "key", "q", "k"):
        proj = getattr(attn, name, None)
        if isinstance(proj, torch.nn.Module):
            for pname, p in proj.named_parameters():
                p.mul_(factor)
                changed.append(f"{attention}.{name}.{pname}")
    if not changed:
        raise ValueError(f"{attention} ({type(attn).__name__}) has no query/key projection ampguard knows")
    return changed


def run(family: str, *, device: str = "cpu", variant: str = "plain", bad_step: int = 1, steps: int | None = None,
        big: bool = False, seq: int = SEQ, batch: int = BATCH, keep_cache: bool = False) -> dict[str, Any]:
    """Train ``family`` for ``steps`` guarded fp16 steps (default: up to the step the name is due,
    and one more); its q/k grow before step ``bad_step``. Returns what each step's first
    non-finite anomaly named, the attention module expected, and (``keep_cache``) the KV cache
    each forward returned, as it was after the step."""
    torch.manual_seed(0)
    model, attention = FAMILIES[family](big)
    model.to(device).train()
    config = {"sentinel": "top"} if variant == "sentinel" else {}
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler(torch.device(device).type), config=config)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    steps = bad_step + 3 if steps is None else steps
    caches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    t0 = time.perf_counter()
    for step in range(steps):
        if step == bad_step:
            grow_qk(model, attention)
        ids = torch.randint(2, vocab, (batch, seq), generator=g).to(device)
        out: list[Any] = []

        def closure(ids: torch.Tensor = ids, out: list[Any] = out) -> torch.Tensor:
            opt.zero_grad()
            with opt.autocast():
                result = model(input_ids=ids, labels=ids)
            opt.backward(result.loss)
            out[:] = [result]
            return result.loss

        if variant == "replay":
            opt.step(closure, replay=True)
        else:
            closure()
            before = _cached_keys(out[0]) if keep_cache else []
            opt.step()
            if keep_cache:  # the cache this forward returned, before and after the guarded step
                caches.append((before, _cached_keys(out[0])))
        opt.zero_grad(set_to_none=True)
    opt.flush()
    seconds = time.perf_counter() - t0
    first: dict[int, Any] = {}
    for a in opt.anomalies:
        if a.kind in ("nonfinite_loss", "nonfinite_grad", "overflow"):
            first.setdefault(a.step, a)
    skipped = [r.step for r in opt.history if r.skipped]
    opt.close()
    return {
        "family": family, "variant": variant, "attention": attention, "bad_step": bad_step, "skipped": skipped,
        "steps": {s: {"module": a.module, "phase": a.phase and str(a.phase), "cause": a.cause and str(a.cause),
                      "detail": a.detail} for s, a in sorted(first.items())},
        "caches": caches, "seconds": seconds,
    }


def _cached_keys(result: Any) -> list[torch.Tensor]:
    """Clones of each layer's cached keys in the KV cache a forward returned ([] without one)."""
    cache = getattr(result, "past_key_values", None)
    cache = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder cache: the decoder's own
    return [layer.keys.detach().clone() for layer in getattr(cache, "layers", None) or []
            if getattr(layer, "keys", None) is not None]


def named(result: dict[str, Any]) -> dict[str, Any]:
    """The first step that names a module, and what it names; ``first_bad``: the first skipped step
    and what its anomaly named."""
    bad = result["skipped"][0] if result["skipped"] else None
    at = next(((s, v) for s, v in result["steps"].items() if v["module"] is not None and v["cause"] is not None),
              None)
    return {
        "expected_module": result["attention"], "first_bad": bad,
        "first_bad_named": {k: result["steps"][bad][k] for k in ("module", "phase", "cause")} if bad in
        result["steps"] else None,
        "step": at[0] if at else None, "module": at[1]["module"] if at else None,
        "phase": at[1]["phase"] if at else None, "cause": at[1]["cause"] if at else None,
        "detail": at[1]["detail"] if at else None, "seconds": round(result["seconds"], 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of: " + ", ".join(FAMILIES))
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--gpt2-124m", action="store_true", help="GPT-2 at its 124M configuration (sequence 128)")
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    import transformers

    results: dict[str, Any] = {}
    for family in args.families.split(","):
        big = args.gpt2_124m and family == "gpt2"
        results[family] = {}
        for variant in args.variants.split(","):
            r = run(family, device=args.device, variant=variant, big=big, seq=128 if big else SEQ,
                    batch=4 if big else BATCH)
            results[family][variant] = named(r)
            print(family, variant, {k: v for k, v in results[family][variant].items() if k != "detail"}, flush=True)
    out = {
        "command": " ".join(["python", "benchmarks/hf_classification.py", *(argv if argv is not None else
                                                                            sys.argv[1:])]),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "gpt2_124m": args.gpt2_124m, "results": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
