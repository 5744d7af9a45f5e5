"""On CUDA: the real causes of ``tests/unit/_scenarios.py`` (issue 14) are named as on the CPU:
the same module, phase, cause and first parameter. The first bad step comes from the run (CUDA's
fp16 kernels may overflow a step earlier or later than the CPU's); the name comes on that step
with ``opt.step(closure, replay=True)``, one step later without (a non-fused optimizer: the
report is decoded when the step has synchronised, as ``docs/diagnosis.md`` states)."""

from __future__ import annotations

import pytest
import torch

from ..unit import _scenarios as S
from ..unit.test_diagnosis_scenarios import EXPECTED

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("closure", [False, True], ids=["no_closure", "replay"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_real_cause_is_named_on_cuda(name, closure):
    module, phase, cause, param, *_ = EXPECTED[name]
    result = S.run(name, closure=closure, device="cuda")
    assert result["skipped"], f"{name}: the cause did not occur on CUDA"
    first_bad = min(result["skipped"])
    found = S.named(result)
    step = first_bad if closure else first_bad + 1
    assert all(s >= step for s in found), found  # nothing named early (nor wrong)
    assert found[step] == (module, phase, cause, param, ()), found
    if closure:
        assert all(a[4] != "transient" for a in result["anomalies"])  # reproduced: never transient


@pytest.mark.parametrize("batched", [False, True], ids=["summed", "batched"])
def test_sentinel_names_the_block_in_its_own_step_on_cuda(batched: bool, monkeypatch: pytest.MonkeyPatch,
                                                          device: str = "cuda") -> None:
    """With ``GuardConfig(sentinel="top")`` the block is named in the bad step's own report; batched too
    (``AMPGUARD_SENTINEL_BATCH=1``, stop 65: the outputs read by one ``_foreach_norm`` when the model returns)."""
    first_bad = min(S.run("attention_overflow", closure=False, device=device)["skipped"])
    monkeypatch.setenv("AMPGUARD_SENTINEL_BATCH", "1" if batched else "0")  # read when the sentinel is made
    result = S.run("attention_overflow", closure=False, device=device, config={"sentinel": "top"})
    assert min(result["skipped"]) == first_bad
    assert any(a[0] == first_bad and a[2] is not None and a[2].startswith("blocks.0") for a in result["anomalies"]), \
        result["anomalies"]
