"""On CUDA: each step's peak device memory reaches the report and the Prometheus series."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, generate_latest

import ampguard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_memory_peaks_per_step_in_report_and_metrics():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).cuda()
    registry = CollectorRegistry()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), fused=True), model=model, precision="fp16",
                        exporters=[ampguard.PrometheusExporter(port=0, addr="127.0.0.1", registry=registry)])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for batch in (64, 64, 4096, 64):
        x = torch.randn(batch, 256, device="cuda")
        y = torch.randint(0, 10, (batch,), device="cuda")
        with opt.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.flush()
    h = opt.history
    for r in h:
        assert r.memory_allocated_peak is not None and r.memory_reserved_peak is not None
        assert weights < r.memory_allocated_peak <= r.memory_reserved_peak
    # the window is one step: the big batch's peak shows on its step only
    assert h[2].memory_allocated_peak > h[1].memory_allocated_peak
    assert h[3].memory_allocated_peak < h[2].memory_allocated_peak  # reset after each step
    text = generate_latest(registry).decode()
    line = next(ln for ln in text.splitlines()
                if ln.startswith("ampguard_device_memory_peak_bytes{") and 'kind="allocated"' in ln)
    assert float(line.split()[-1]) == h[3].memory_allocated_peak
    opt.close()
