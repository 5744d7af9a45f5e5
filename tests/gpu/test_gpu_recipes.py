"""The upstream recipes of tests/frameworks on CUDA: ``model.zero_grad()`` between steps
(test_zero_grad_elsewhere.py), ``torch.compile(opt.step)`` and a compiled training step
(test_compiled_calls.py), ``torch.distributed.checkpoint`` through ``ampguard.integrations.dcp`` (test_dcp.py)
and the usage patterns (test_usage_patterns.py), each module run as it is with ``AMPGUARD_RECIPE_DEVICE=cuda``
in a subprocess (the modules read it at import). Skipped without CUDA; ``make test`` runs the same modules on
the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("test_zero_grad_elsewhere.py", "test_compiled_calls.py", "test_dcp.py", "test_usage_patterns.py")


@pytest.mark.parametrize("module", MODULES)
def test_recipe_module_passes_on_cuda(module: str) -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "AMPGUARD_RECIPE_DEVICE": "cuda"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           str(ROOT / "tests" / "frameworks" / module)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, tail
    assert " passed" in done.stdout.strip().splitlines()[-1], tail
