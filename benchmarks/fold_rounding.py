#!/usr/bin/env python
"""How far the clip folded into the fused step (``GuardedOptimizer.clip_grad_norm_`` with a GradScaler and fused
AdamW: ``grad_scale = scale / coef``) moves an update from the plain loop's ``unscale_`` + ``clip_grad_norm_`` +
``scaler.step``, on a tiny GPT-2 (``transformers`` config, no dropout) in fp16 autocast on the CPU: per step, the
guard's and torch's total norm, the largest parameter difference, and after the first step where the parameters
differ, by how many ulps of each value (docs/design.md, "What stop 34 taught").

    python benchmarks/fold_rounding.py --steps 20
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampguard


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0,
                                      embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0))


def _run(guarded: bool, data: list[torch.Tensor], clip: float) -> list[tuple[list[torch.Tensor], float]]:
    model = _gpt2()
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    if guarded:
        opt = ampguard.wrap(opt, model=model, scaler=scaler, precision="fp16", exporters=[])
    out = []
    for x in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=x, labels=x).loss
        if guarded:
            opt.backward(loss)  # type: ignore[attr-defined]
            norm = opt.clip_grad_norm_(clip)  # type: ignore[attr-defined]
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        out.append(([p.detach().clone() for p in model.parameters()], float(norm)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--clip", type=float, default=0.05, help="below every step's norm: every step clips")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (8, 32), generator=g) for _ in range(args.steps)]
    plain, guarded = _run(False, data, args.clip), _run(True, data, args.clip)
    first = True
    for step, ((pa, na), (pb, nb)) in enumerate(zip(plain, guarded)):
        diff = max(float((a - b).abs().max()) for a, b in zip(pa, pb))
        print(f"step {step:3d}  norm plain {na:.9g} guard {nb:.9g}  max |param diff| {diff:.3e}")
        if first and diff > 0:
            first = False
            differing = sum(int((a != b).sum()) for a, b in zip(pa, pb))
            total = sum(a.numel() for a in pa)
            start = [p.detach() for p in _gpt2().parameters()] if step == 0 else plain[step - 1][0]
            eps = torch.finfo(torch.float32).eps
            # in units of eps x the largest magnitude the update involved (before, after, the update itself): the
            # measure tests/gpu/test_gpu_frameworks.py holds the first folded update to (4)
            ulps = max(float(((a - b).abs() / (eps * torch.maximum(torch.maximum(b.abs(), s.abs()), (b - s).abs())
                                               .clamp_min(torch.finfo(torch.float32).tiny))).max())
                       for a, b, s in zip(pb, pa, start))
            print(f"  first differing step: {differing} of {total} elements ({100 * differing / total:.1f} %), "
                  f"at most {ulps:.2f} ulps of the update's largest magnitude")


if __name__ == "__main__":
    main()
