"""Stop 62: sentinel="top" on a Hugging Face GPT-2 compiled by inductor (the CPU's C++ backend), fp16 with a
GradScaler: an fp16 overflow made in transformer.h.1's MLP at step 5 (c_fc's weight times 1e30: non-finite once
cast to fp16) is named by the sentinel on its step, then inside the block by the armed hooks. tests/unit/
test_sentinel.py's compile test runs the same with a recording backend (fast); this is the inductor run. Run from the
repository root: PYTHONPATH=$PWD python benchmarks/results/cpu_stop62/sentinel_inductor.py [backend]"""

from __future__ import annotations

import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ampguard

warnings.filterwarnings("ignore")


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    compiled = torch.compile(model, backend=sys.argv[1] if len(sys.argv) > 1 else "inductor")
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model=compiled,
                        scaler=torch.amp.GradScaler("cpu"), precision="fp16",
                        config=ampguard.GuardConfig(sentinel="top"))
    x = torch.randint(0, 64, (2, 8))
    for step in range(8):
        if step == 5:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight.mul_(1e30)
        with torch.autocast("cpu", dtype=torch.float16):
            out = compiled(input_ids=x, labels=x)
        opt.backward(out.loss)
        opt.step()
        opt.zero_grad()
        r = opt.last_report
        print(step, "skipped" if r.skipped else "stepped", r.reason, r.loss)
    for a in opt.anomalies:
        print("anomaly", a.step, a.module, a.phase, a.cause)
    opt.close()


if __name__ == "__main__":
    main()
