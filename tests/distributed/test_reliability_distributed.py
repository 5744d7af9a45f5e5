"""Issue 15 on 2 real gloo ranks, in one spawn: a step where one rank's backward reached no
parameter is skipped on every rank (the gather still runs everywhere: no desync, no hang), and
the next steps are healthy on both; a closed guard leaves no thread running and does not keep
the DDP model alive past ``del`` (so nothing of DDP need outlive the process group)."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ampguard
from ampguard.exporters import JsonlExporter, PrometheusExporter

from ._common import batch, spawn, tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out = {precision: _train_no_grads_on_rank_1(rank, precision) for precision in ("fp16", "bf16")}
    out["teardown"] = _teardown(rank, Path(tmp))
    return out


def _teardown(rank: int, tmp: Path) -> dict[str, Any]:
    model = DDP(tiny_model())
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="bf16",
                        exporters=[JsonlExporter(tmp / "events.jsonl"), PrometheusExporter(port=0, addr="127.0.0.1")])
    for step in range(3):
        x, y = batch(rank, step)
        with opt.autocast():
            opt.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    opt.close()
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("ampguard"))
    refs = weakref.ref(opt), weakref.ref(model)
    gc.disable()  # freed by reference counting, as a plain DDP model is: not left to the collector
    try:
        del opt, model
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    return {"threads_after_close": threads, "alive_after_del": alive}


def _train_no_grads_on_rank_1(rank: int, precision: str) -> dict[str, Any]:
    model = tiny_model()  # no DDP: DDP's own reducer would wait for the detached rank's gradients
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision=precision,
                        scaler=torch.amp.GradScaler("cpu", init_scale=256.0) if precision == "fp16" else None)
    outside = torch.ones((), requires_grad=True)
    for step in range(5):
        x, y = batch(rank, step)
        with opt.autocast():
            out = model(x).float()
        if step == 2 and rank == 1:
            out = out.detach() * outside  # this rank's backward reaches no parameter
        opt.backward(torch.nn.functional.mse_loss(out, y))
        opt.step()
        opt.zero_grad()
    opt.flush()
    result = {"reasons": [r.reason for r in opt.history],
              "anomalies": [(a.step, str(a.kind), a.ranks) for a in opt.anomalies],
              "scale": opt.get_scale()}
    opt.close()
    return result


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory) -> list[dict[str, Any]]:
    return spawn(_body, tmp=str(tmp_path_factory.mktemp("ranks")))


def test_one_rank_without_gradients_skips_the_step_on_every_rank(by_rank):
    # before (issue 15): rank 1 raised torch's "Expected !nested_tensorlist[0].empty()" before the
    # gather; rank 0, in the gather, failed with gloo's "Connection closed by peer" when rank 1's
    # process ended (had rank 1 caught the error and gone on, rank 0 would have waited there)
    for precision in ("fp16", "bf16"):
        results = [r[precision] for r in by_rank]
        for res in results:
            assert res["reasons"] == [None, None, "no_gradients", None, None], precision
            assert res["anomalies"] == [(2, "no_gradients", (1,))], precision
        assert results[0]["scale"] == results[1]["scale"]


def test_a_closed_guard_leaves_no_thread_and_does_not_keep_ddp_alive(by_rank):
    # before (issue 15): the guard and its reporter formed a reference cycle, so `del opt, model`
    # left the DDP model (its reducer, its process group) to the cyclic collector: [True, True]
    for res in by_rank:
        assert res["teardown"] == {"threads_after_close": [], "alive_after_del": [False, False]}
