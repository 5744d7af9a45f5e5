"""Stop 46: what the first Python work after a training step's kernels costs, against the same work run right after it.

A GPT-2 of GPT-2 350M's parameter count (292 tensors: 24 layers, width 32) trains on the CPU, guarded, with the tensor
decision (as on CUDA: each report is a packed payload). Inside ``Reporter.decode``, before it runs, three pieces of work
are timed back to back (thread time): making 323 Python floats in a comprehension, the payload's ``tolist()`` (323
floats), and the same comprehension again. The mean over the steps, µs (README.md here)::

    AMPGUARD_REPORT_BATCH=0 OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop46/cold_first_touch.py
"""

import os
import time
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ampguard
import ampguard.reporter as reporter

warnings.filterwarnings("ignore")
N = int(os.environ.get("N", 300))
T = {"first floats": 0, "tolist": 0, "floats again": 0}
calls = [0]
decode = reporter.Reporter.decode


def timed_decode(self, before=None):
    for p in list(self._pending):
        if p.buf is not None and (before is None or p.step < before):
            n = p.buf.numel()
            t0 = time.thread_time_ns()
            [float(k) + 0.5 for k in range(n)]
            t1 = time.thread_time_ns()
            p.buf.tolist()
            t2 = time.thread_time_ns()
            [float(k) + 0.5 for k in range(n)]
            t3 = time.thread_time_ns()
            T["first floats"] += t1 - t0
            T["tolist"] += t2 - t1
            T["floats again"] += t3 - t2
            calls[0] += 1
            break  # the first payload due: the first Python work after the step's kernels
    return decode(self, before)


reporter.Reporter.decode = timed_decode
cfg = GPT2Config(vocab_size=256, n_positions=64, n_layer=24, n_embd=32, n_head=4)
model = GPT2LMHeadModel(cfg)
ids = torch.randint(0, 256, (2, 16))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
g = ampguard.wrap(opt, model=model, scaler=torch.amp.GradScaler("cpu", init_scale=1024), precision="fp16",
                  exporters=[])
g._pipeline.host_decision, g._lagged_reports = False, True  # the tensor decision: packed payloads, as on CUDA
for _ in range(N):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    g.backward(loss)
    g.step()
    g.zero_grad()
print(f"{len(list(model.parameters()))} tensors, {calls[0]} decodes; mean thread time, us: "
      + ", ".join(f"{k} {v / calls[0] / 1e3:.1f}" for k, v in T.items()))
