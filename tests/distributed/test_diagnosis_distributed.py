"""Issue 14's real-cause scenarios on one rank of two (gloo, DDP): every rank names the same
module, phase, cause and parameter, and the rank where the cause occurred. One spawn runs them
all in sequence (``tests/unit/_scenarios.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit import _scenarios as S
from tests.unit.test_diagnosis_scenarios import EXPECTED

from ._common import spawn

pytestmark = pytest.mark.distributed

CULPRIT = 1
# As in one process, but the learning-rate explosion: DDP averages both ranks' gradients, so the
# weights follow another path and a later layer (4) is the first to overflow, on rank 1 only.
EXPECTED_2 = {**EXPECTED, "lr_explosion": ("4", "forward", "overflow", "4.weight", 13, 14, 13)}
RUNS = [*((name, closure) for name in EXPECTED for closure in (False, True)),
        ("glitch", True), ("persistent_fault", True)]


def _all_scenarios(rank: int, world: int) -> dict[str, Any]:
    ddp = torch.nn.parallel.DistributedDataParallel
    out = {f"{name}:{closure}": S.run(name, closure=closure, rank=rank, world=world, culprit=CULPRIT,
                                      wrap_model=lambda m: ddp(m))
           for name, closure in RUNS}
    out["sentinel"] = S.run("attention_overflow", closure=False, rank=rank, world=world, culprit=CULPRIT,
                            wrap_model=lambda m: ddp(m), config={"sentinel": "top"})
    return out


def test_each_scenario_on_one_rank_of_two_names_that_rank():
    r0, r1 = spawn(_all_scenarios)
    for key in r0:
        a0 = [a[:7] for a in r0[key]["anomalies"]]
        assert a0 == [a[:7] for a in r1[key]["anomalies"]], key  # the same view on every rank
        # the step is skipped on every rank: each quarantines its own batch of it
        assert r1[key]["quarantine"] and all(rank == CULPRIT for rank, _ in r1[key]["quarantine"]), key
    for name, (module, phase, cause, param, first_bad, plain_step, replay_step) in EXPECTED_2.items():
        for closure, step in ((False, plain_step), (True, replay_step)):
            result = r0[f"{name}:{closure}"]
            found = S.named(result)
            assert min(result["skipped"]) == first_bad, (name, closure, result["skipped"])
            assert all(s >= step for s in found), (name, closure, found)
            assert found[step] == (module, phase, cause, param, (CULPRIT,)), (name, closure, found)
            assert f"rank {CULPRIT}:" in next(a[7] for a in result["anomalies"] if a[0] == step)
    glitch = {a[0]: a for a in r0["glitch:True"]["anomalies"]}
    assert (glitch[2][2], glitch[2][4], glitch[2][6]) == (None, "transient", (CULPRIT,))
    assert (glitch[4][2], glitch[4][4], glitch[4][6]) == ("blocks.1.mlp", "transient", (CULPRIT,))
    (persistent,) = [a for a in r0["persistent_fault:True"]["anomalies"] if a[0] == 3]
    assert (persistent[2], persistent[4], persistent[6]) == ("blocks.1.mlp", "not_reproduced", (CULPRIT,))
    # The sentinel: the block on the first bad step itself, rank 1's view on every rank; then the
    # hooks inside that block name the attention and its cause.
    first = {a[0]: a for a in r0["sentinel"]["anomalies"]}
    assert first[3][2:5] == ("blocks.0", "forward", None) and first[3][6] == (CULPRIT,)  # no recompute: no cause
    assert S.named(r0["sentinel"]) == {4: ("blocks.0.attn", "forward", "overflow", "blocks.0.attn.q.weight",
                                           (CULPRIT,))}
    assert [a[:7] for a in r0["sentinel"]["anomalies"]] == [a[:7] for a in r1["sentinel"]["anomalies"]]
