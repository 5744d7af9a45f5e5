"""Stop 39: what the clip's "are these the guarded parameters?" test costs per call, before and after, on a
GPT-2 of 292 parameter tensors (24 layers, width 32).
Run: PYTHONPATH=$PWD python benchmarks/results/cpu_stop39/clip_sets.py"""
import operator
import timeit

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ampguard

model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_layer=24, n_embd=32, n_head=4))
opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), fused=True), model=model, precision="fp16", exporters=[])
params, chosen = opt._pipeline.params(), list(model.parameters())
requires_grad = operator.attrgetter("requires_grad")
cases = {
    "guard, parameters=None, before": lambda: {id(p) for p in params if p.requires_grad} == {id(p) for p in params},
    "guard, parameters=None, after": lambda: all(map(requires_grad, params)),
    "guard, parameters given, before": lambda: {id(p) for p in chosen if p.requires_grad} == {id(p) for p in params},
    "guard, parameters given, after": lambda: {id(p) for p in chosen if p.requires_grad} == opt._pipeline.param_ids(),
}
print(f"{len(params)} parameters; median of 7 repeats of 2000 calls, us a call")
for name, fn in cases.items():
    runs = sorted(timeit.repeat(fn, number=2000, repeat=7))
    print(f"  {name:36s} {runs[3] / 2000 * 1e6:6.1f}")
