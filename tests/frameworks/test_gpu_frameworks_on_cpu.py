"""The GPU framework tests' bodies (``tests/gpu/test_gpu_frameworks.py``), run on the CPU in ``make test``.

Those tests run on CUDA only when someone runs them on the device, so a change that breaks them can go unseen for
sessions: the clip folded into the fused step (fp16, fused AdamW, the framework's clip) made the guarded run differ
from the plain one by rounding, and the bitwise check there failed from the commit that folded it until it was
next run on the H200. Their CPU stand-ins (``AMPGUARD_GPU_TESTS_ON_CPU=1``: bf16 as is, fp16 through what each
framework builds on CUDA) run here, in a subprocess (the module reads the variable at import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.frameworks

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_framework_bodies_pass_on_the_cpu() -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    env = {**os.environ, "AMPGUARD_GPU_TESTS_ON_CPU": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           str(ROOT / "tests" / "gpu" / "test_gpu_frameworks.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, tail  # every case ran (none skipped as CUDA-only)
