"""Train a tiny Llama with torchao float8 under ampguard: every fp8 cast watched, a poisoned cast caught on its step.

The model is ``transformers``' Llama at a tiny size (built from ``LlamaConfig``: nothing is downloaded), its linear
layers converted with ``torchao.float8.convert_to_float8_training`` (``lm_head`` left in bf16), trained under bf16
autocast with fused AdamW where the device has it. ``ampguard.wrap(opt, model=model)`` sees the ``Float8Linear``
layers and monitors their casts by itself (amax and torchao's scale each step, the underflow every
``numerics_every`` steps). On a CPU, or a GPU without fp8 matmuls (compute capability below 8.9), the float8
matmuls are emulated (``Float8LinearConfig(emulate=True)``).

At ``--fault-step`` an Inf is put into ``model.layers.0.mlp.up_proj``'s output (:mod:`ampguard.faults`): the
MLP's product carries it into ``down_proj``'s input, whose fp8 cast then has amax inf and torchao's scale 0,
which zeroes the cast and turns the Inf into NaN. The guard skips that step on every rank and names the cast:
``model.layers.0.mlp.down_proj, input: amax inf → scale 0``.

    pip install 'ampguard[fp8]' transformers
    python examples/train_fp8.py                          # 40 steps, the fault at step 15
    python examples/train_fp8.py --steps 20 --fault-step 6 --out summary.json
    python examples/train_fp8.py --no-fault

Exit code 0 when the run finished and the loss went down; 1 when the guard stopped it (``NonFiniteError``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

import ampguard
from ampguard import faults


def build(device: torch.device) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device)
    fp8_matmuls = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return convert_to_float8_training(model, config=Float8LinearConfig(emulate=not fp8_matmuls),
                                      module_filter_fn=lambda module, fqn: fqn != "lm_head")


def batch(step: int, device: torch.device) -> torch.Tensor:
    """Token sequences with a pattern to learn: each row counts up from a random start, modulo the vocabulary."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 128, (4, 1), generator=g)
    return ((start + torch.arange(32)) % 128).to(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fault-step", type=int, default=15)
    p.add_argument("--no-fault", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write a JSON summary here")
    args = p.parse_args(argv)
    device = torch.device(args.device)

    model = build(device)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=device.type == "cuda")
    opt = ampguard.wrap(inner, model=model, precision="bf16", config={"numerics_every": 5})
    plan = [] if args.no_fault else [faults.output("model.layers.0.mlp.up_proj", "inf", steps=[args.fault_step])]
    losses: list[float | None] = []
    stopped = None
    with faults.inject(opt, model, *plan):
        try:
            for step in range(args.steps):
                ids = batch(step, device)
                with opt.autocast():
                    loss = model(input_ids=ids, labels=ids).loss
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
        except ampguard.NonFiniteError as exc:
            stopped = str(exc)
    opt.flush()
    for report in opt.history:
        losses.append(report.loss)
    casts = next((r.fp8 for r in opt.history if r.fp8), ())
    summary: dict[str, Any] = {
        "steps": opt.step_count,
        "skipped": [r.step for r in opt.history if r.skipped],
        "reasons": {r.step: str(r.reason) for r in opt.history if r.skipped},
        "fp8_anomalies": [{"step": a.step, "module": a.module, "detail": a.detail}
                          for a in opt.anomalies if a.kind == "fp8_nonfinite"],
        "float8_casts_per_step": len(casts),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "stopped": stopped,
    }
    opt.close()
    for a in summary["fp8_anomalies"]:
        print(f"step {a['step']}: {a['detail']}")
    print(f"{summary['steps']} steps, skipped {summary['skipped']}, {summary['float8_casts_per_step']} fp8 casts "
          f"watched a step; loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    if stopped is not None:
        print(f"stopped: {stopped}", file=sys.stderr)
        return 1
    first, last = summary["first_loss"], summary["last_loss"]
    return 0 if first is not None and last is not None and last < first else 1


if __name__ == "__main__":
    sys.exit(main())
