"""On real CUDA hardware: the z-score detector and ZClip add no host sync, their decision is
captured in the CUDA graph (no capture-failure warning), and the graph's decisions are the eager
ones, bit for bit, through a bad batch. Skipped without CUDA. Run: ``pytest -m gpu tests/gpu -v``."""

from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import ampguard

from .test_gpu import _adamw, _batches, _model, _Plain, assert_no_added_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = {"spikes": {"grad_zscore": 4.0, "warmup": 5, "action": "skip"}, "zclip": {"warmup": 5}}


class _Guarded:
    def __init__(self, graph: bool):
        self.model = _model(0)
        # the decision's own graph (the step graph, on by default, decides in its replay: test_gpu_step_graph.py)
        env = {"AMPGUARD_CUDA_GRAPH": "1" if graph else "0", "AMPGUARD_STEP_GRAPH": "0"}
        with mock.patch.dict(os.environ, env):  # read at wrap time
            self.opt = ampguard.wrap(_adamw(self.model, fused=True), model=self.model, precision="fp16",
                                     scaler=torch.amp.GradScaler("cuda", init_scale=2.0**10), config=CONFIG)

    def step(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> None:
        with self.opt.autocast():
            loss = F.cross_entropy(self.model(x), y) * scale
        self.opt.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def test_detectors_add_no_host_sync_and_are_captured() -> None:
    batches = _batches(24)
    runs = {}
    for graph in (True, False):
        g = _Guarded(graph)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
            for i, b in enumerate(batches):
                g.step(*b, scale=50.0 if i == 15 else 1.0)  # a bad batch at step 15
        g.opt.flush()
        if graph:
            assert g.opt._pipeline.graph._graph is not None  # captured and replayed
        runs[graph] = [(r.grad_spike, r.skipped, r.clip_coef, r.spike_threshold, r.clip_threshold, r.grad_norm)
                       for r in g.opt.history]
    assert runs[True] == runs[False]
    assert runs[True][15][0] and runs[True][15][1]  # the bad batch: flagged and skipped
    assert any(r[2] < 1.0 for r in runs[True])  # ZClip clipped
    guarded = _Guarded(True)
    assert_no_added_sync(guarded, _Plain(fused=True, init_scale=2.0**10), batches, guarded.opt._pipeline.measure_graph)
