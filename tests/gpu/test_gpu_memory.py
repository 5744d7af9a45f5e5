"""On CUDA: peak device memory reaches the report and the Prometheus series, and the guard leaves
the user's own peak statistics alone (issue 15, item 7) unless per-step peaks are asked for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, generate_latest

import ampguard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).cuda()


def _steps(opt: ampguard.GuardedOptimizer, model: torch.nn.Module, batches: tuple[int, ...]) -> None:
    for batch in batches:
        x = torch.randn(batch, 256, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        with opt.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.flush()


def test_the_users_peak_memory_statistics_survive_guarded_steps():
    # issue 15: after a 512 MiB peak of the user's, 3 guarded steps left max_memory_allocated() at 67 MiB
    model = _model()
    registry = CollectorRegistry()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), fused=True), model=model, precision="fp16",
                        exporters=[ampguard.PrometheusExporter(port=0, addr="127.0.0.1", registry=registry)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    del big
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    assert peak >= 512 << 20
    _steps(opt, model, (64, 64, 64, 64))
    assert torch.cuda.max_memory_allocated() >= peak >= 512 << 20
    assert torch.cuda.max_memory_reserved() >= reserved
    # the exporter reads the high-water mark itself: the user's peak included
    text = generate_latest(registry).decode()
    value = {kind: float(next(ln for ln in text.splitlines() if ln.startswith("ampguard_device_memory_peak_bytes{")
                              and f'kind="{kind}"' in ln).split()[-1]) for kind in ("allocated", "reserved")}
    assert value["reserved"] >= value["allocated"] >= 512 << 20
    opt.close()
