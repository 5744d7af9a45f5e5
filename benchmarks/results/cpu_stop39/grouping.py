"""Stop 39: ampguard.stats.grads_by_device_and_dtype on GPT-2's 292 gradients (24 layers, width 32), on the tree
it is run from. Run: cd <tree> && PYTHONPATH=<tree> python <this file>"""
import timeit

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ampguard.stats import grads_by_device_and_dtype

model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_layer=24, n_embd=32, n_head=4))
ids = torch.randint(0, 256, (2, 16))
model(input_ids=ids, labels=ids).loss.backward()
params = list(model.parameters())
runs = sorted(timeit.repeat(lambda: grads_by_device_and_dtype(params), number=3000, repeat=7))
print(f"{len(params)} gradients: grads_by_device_and_dtype {runs[3] / 3000 * 1e6:.1f} us (median of 7 x 3000 calls)")
