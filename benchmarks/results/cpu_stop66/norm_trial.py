#!/usr/bin/env python
"""Stop 66: would ``torch._foreach_norm`` (``clip_grad_norm_``'s kernel) beat :func:`ampguard.stats.cpu_norms`'s dots
on the CPU row's non-fused optimizer, on this session's 2-core AVX-512 host? ``stats.cpu_norms`` is replaced in this
process only (MODE ``foreach``; ``dot`` leaves it), then the benchmark runs as its own command line::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop66/norm_trial.py MODE host
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop66/norm_trial.py MODE table OUT.json

``host``: ``host_time.py --device cpu --models mlp-small --optims foreach --blocks 6 --steps 30 --clock thread``;
``table``: ``table.py --device cpu --groups mlp-small --blocks 300 --profile-steps 0 --no-memory --no-syncs
--cpu-autocast off --out OUT.json`` (the CPU row's command)."""
import runpy
import sys
from pathlib import Path

import torch

import ampguard.stats as stats

ROOT = Path(__file__).resolve().parents[3]
mode, bench = sys.argv[1], sys.argv[2]
if mode == "foreach":
    stats.cpu_norms = lambda grads: torch.stack(torch._foreach_norm(list(grads), 2.0))
elif mode != "dot":
    raise SystemExit(f"MODE: dot or foreach, not {mode!r}")
if bench == "host":
    sys.argv = ["host_time.py", "--device", "cpu", "--models", "mlp-small", "--optims", "foreach", "--blocks", "6",
                "--steps", "30", "--clock", "thread"]
else:
    sys.argv = ["table.py", "--device", "cpu", "--groups", "mlp-small", "--blocks", "300", "--profile-steps", "0",
                "--no-memory", "--no-syncs", "--cpu-autocast", "off", "--out", sys.argv[3]]
runpy.run_path(str(ROOT / "benchmarks" / sys.argv[0]), run_name="__main__")
