"""Stop 56: forward and backward of mlp-small on this host, bf16 autocast against float32 (the CPU table's models).
Run from the repository root: OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop56/fwd_bwd.py"""

import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")  # run from the repository root
import overhead as ov  # noqa: E402

size = ov.SIZES["mlp-small"]
dev = torch.device("cpu")
batch = ov.make_batch(size, dev)
m = ov.build_model(size, dev)
print(size)
for bf16 in (True, False):
    for i in range(6):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ov.compute_loss(m, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i >= 3:  # after three warm-up iterations
            print("bf16 autocast" if bf16 else "float32", f"forward {1e3 * (t1 - t0):.2f} ms",
                  f"backward {1e3 * (t2 - t1):.2f} ms")
