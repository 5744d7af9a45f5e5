"""Horovod on 2 real ranks (horovod.run, gloo, CPU): the synchronize / unscale / step order,
one decision on every rank, attribution through the wrapped compression, consistency checks,
escalation, backward_passes_per_step, Compression.fp16, Adasum refused, state broadcast.
All scenarios run inside one launch (a launch costs seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ampguard
from ampguard import faults

from ._common import assert_same_everywhere, standard_faults, tiny_model, train

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(240)]

hvd_run = pytest.importorskip("horovod.runner").run
REPO = str(Path(__file__).resolve().parents[2])


def _body() -> dict[str, Any]:
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    out: dict[str, Any] = {"rank": rank}

    def dist_opt(model: torch.nn.Module, fused: bool = False, **kw: Any) -> Any:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **kw)

    # 1. faults on rank 1 only (loss @2, gradient before @4 / after @6 reduction), fp16, fused and not
    for fused in (False, True):
        model = tiny_model()
        opt = ampguard.wrap(dist_opt(model, fused), model=model, precision="fp16",
                            config={"consistency_every": 1})
        out["backend"] = opt.backend.name
        with faults.inject(opt, model, *standard_faults("0.weight")):
            out[f"faults_{fused}"] = train(opt, model, rank, 8)
        opt.close()

    # 2. backward_passes_per_step=2 with Compression.fp16; an inf in rank 1's gradient at step 3
    model = tiny_model()
    opt = ampguard.wrap(
        dist_opt(model, backward_passes_per_step=2, compression=hvd.Compression.fp16),
        model=model, precision="fp16", scaler=torch.amp.GradScaler("cpu", init_scale=256.0),
    )
    with faults.inject(opt, model, faults.grad("2.weight", "inf", steps=[3], ranks=[1])):
        out["bpps"] = train(opt, model, rank, 6, micro_batches=2)
    opt.close()

    # 3. bf16 with Compression.fp16 warns
    model = tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ampguard.wrap(dist_opt(model, compression=hvd.Compression.fp16), model=model, precision="bf16")
    out["bf16_fp16_warning"] = any("Compression.fp16" in str(w.message) for w in caught)
    opt.close()

    # 4. a parameter perturbed on rank 1: rank_divergence naming it; and on_divergence="raise"
    for mode in ("warn", "raise"):
        model = tiny_model()
        opt = ampguard.wrap(dist_opt(model), model=model, precision="bf16",
                            config={"consistency_every": 2, "on_divergence": mode})

        def perturb(step: int, model: torch.nn.Module = model) -> None:
            if step == 2 and rank == 1:
                with torch.no_grad():
                    model[0].bias[0] += 1.0

        out[f"divergence_{mode}"] = train(opt, model, rank, 6, before_step=perturb)
        opt.close()

    # 5. max_consecutive_skips: NonFiniteError on every rank at the same step
    model = tiny_model()
    opt = ampguard.wrap(dist_opt(model), model=model, precision="fp16", config={"max_consecutive_skips": 3})
    with faults.inject(opt, model, faults.loss("nan", steps=range(2, 100), ranks=[0])):
        out["escalate"] = train(opt, model, rank, 8)
    opt.close()

    # 5b. replay closure under Horovod (synchronize after the replay's backward): a one-off fault on
    # rank 1 is classified transient on its own step, and the ranks stay together
    model = tiny_model()
    opt = ampguard.wrap(dist_opt(model), model=model, precision="bf16")
    faults.inject(opt, model, faults.output("0", "nan", steps=[2], ranks=[1], transient=True))
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(4, 8, generator=g)

        def closure(x: torch.Tensor = x) -> None:
            opt.zero_grad()
            opt.backward(model(x).square().mean())

        opt.step(closure, replay=True)
        opt.zero_grad()
    out["replay"] = [(a.step, a.module, a.phase, a.cause, a.ranks) for a in opt.anomalies]
    out["replay_params"] = [p.detach().clone() for p in model.parameters()]
    opt.close()

    # 6. Adasum is refused with a clear error, and the refused wrap leaves no hook on the model: the backend refuses
    # after the sentinel hooked the model's blocks (before stop 51 its hooks stayed)
    model = tiny_model()
    try:
        ampguard.wrap(dist_opt(model, op=hvd.Adasum), model=model, precision="bf16", config={"sentinel": "top"})
        out["adasum"] = None
    except ValueError as e:
        out["adasum"] = str(e)
    out["adasum_hooks"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    # 7. state broadcast: rank 0's scale and counters reach a rank that starts fresh
    from ampguard.backends.horovod import broadcast_guard_state

    model = tiny_model()
    opt = ampguard.wrap(dist_opt(model), model=model, precision="fp16")
    if rank == 0:
        opt.scaler.update(new_scale=torch.tensor(1024.0))
        opt._step, opt._reporter.skipped_total, opt._reporter.history._count = 7, 2, 7  # as if resumed at step 7
    broadcast_guard_state(opt, root_rank=0)
    out["broadcast"] = (opt.get_scale(), opt.step_count, opt.skipped_steps)
    # Horovod's zero_grad() takes no set_to_none; the guard's does, both ways
    opt.backward(model(torch.ones(2, 8)).square().mean())
    opt.step()
    opt.zero_grad(set_to_none=False)
    out["zeroed"] = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.close()
    hvd.shutdown()
    return out


def test_horovod_one_decision_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # the ranks inherit this process's environment: make the repo importable there
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    res = hvd_run(_body, num_proc=2, use_gloo=True, hosts="localhost:2", start_timeout=60)
    res = sorted(res, key=lambda r: r["rank"])
    assert all(r["backend"] == "horovod" for r in res)

    for fused in (False, True):
        runs = [r[f"faults_{fused}"] for r in res]
        assert_same_everywhere(runs, skipped=[2, 4, 6], origin=1)
        assert not [a for r in runs for a in r["anomalies"] if a[1] == "rank_divergence"]
        assert runs[0]["reasons"] == {2: "nonfinite_loss", 4: "nonfinite_grad", 6: "nonfinite_grad"}
        assert runs[0]["scale"] < 65536.0

    assert_same_everywhere([r["bpps"] for r in res], skipped=[3], origin=1)
    assert all(r["bf16_fp16_warning"] for r in res)

    for r in res:
        first = r["divergence_warn"]["anomalies"][0]
        assert first[:3] == (3, "rank_divergence", (1,)), first
        assert "0.bias on rank(s) [1]" in first[3], first  # the second exchange names the parameter
        assert r["divergence_raise"]["error"] == ("RankDivergenceError", 3)
        assert r["escalate"]["error"] == ("NonFiniteError", 4)
        assert r["escalate"]["skipped"] == [2, 3, 4]
        assert r["adasum"] is not None and "Adasum" in r["adasum"]
        assert r["adasum_hooks"] == 0
        assert r["broadcast"] == (1024.0, 7, 2)
        assert r["zeroed"]
        # a first anomaly: no hooks were armed on the first pass, so the clean replay says only "transient";
        # where is unknown: module and phase None (issue 14: module was ""; issue 23: phase was "loss")
        assert r["replay"] == [(2, None, None, "transient", (1,))], r["replay"]
    assert all(torch.equal(a, b) for a, b in zip(res[0]["replay_params"], res[1]["replay_params"]))


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_import_ampguard_does_not_import_horovod() -> None:
    proc = _python("import sys, ampguard, ampguard.backends; assert 'horovod' not in sys.modules, 'imported'")
    assert proc.returncode == 0, proc.stderr


def test_missing_horovod_names_the_extra() -> None:
    # a Python where horovod cannot be imported (sys.modules entry None makes the import fail)
    proc = _python(
        "import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"
        "from ampguard.backends.horovod import HorovodBackend\n"
        "import ampguard\n"
        "try:\n    HorovodBackend()\nexcept ampguard.BackendUnavailableError as e:\n    print('ERR', e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "ampguard[horovod]" in proc.stdout
