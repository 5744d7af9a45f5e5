"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def unscale_calls(monkeypatch):
    """How many times GradScaler ran its unscale/inf-check kernel (``_unscale_grads_``: both
    ``unscale_`` and the fused step's ``_check_inf_per_device`` go through it)."""
    calls: list[int] = []
    original = torch.amp.GradScaler._unscale_grads_

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", counting)
    return calls
