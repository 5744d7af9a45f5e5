"""Stop 59: where the early flag's step spends its host time, against the default step graph's: cProfile of 200
guarded step() calls each (MLP foreach, benchmarks/host_time.py's model), the device drained before each step as
host_time.py times them, functions by own time. Run on the device:
PYTHONPATH=$PWD python benchmarks/results/cpu_stop59/early_profile.py
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import host_time as H

import ampguard


def main() -> None:
    for early in ("0", "1"):
        model, loss_fn = H.build("mlp", torch.device("cuda"))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        with mock.patch.dict(os.environ, {"AMPGUARD_EARLY_SKIP": early}):
            opt = ampguard.wrap(inner, model=model, precision="fp16", exporters=[])
        prof = cProfile.Profile()
        for i in range(260):
            with opt.autocast():
                loss = loss_fn()
            opt.backward(loss)
            torch.cuda.synchronize()
            if i >= 60:
                prof.enable()
            opt.step()
            if i >= 60:
                prof.disable()
            opt.zero_grad()
        print(f"\n=== AMPGUARD_EARLY_SKIP={early}: early_skip={opt._pipeline.early_skip}, step graph "
              f"{opt._pipeline.step_graph.replays} replays, {opt._pipeline.step_graph.captures} captures")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        opt.close()


if __name__ == "__main__":
    main()
