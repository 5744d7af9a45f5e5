"""Peak CUDA memory, read by the exporters that publish it (Prometheus, OpenTelemetry).

Not the guard's job: a step's decision never depends on it. Each exporter reads the caching
allocator's host-side counters when it exports a step: no device sync, and nothing is reset, so
the value is the high-water mark since the process started or since the user's own last
``torch.cuda.reset_peak_memory_stats()``, and the user's ``torch.cuda.max_memory_allocated()`` reads
what it would without ampguard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MemoryPeaks"]


class MemoryPeaks:
    """Peak allocated and reserved bytes of the run's device (``RunInfo.device``); nothing off CUDA.
    ``stats``: torch's ``memory_stats_as_nested_dict`` (a test can hand in an allocator of its own)."""

    def __init__(self, device: str, stats: Callable[[Any], dict[str, Any]] | None = None) -> None:
        self.device = device if device.startswith("cuda") else None
        # One nested-stats call (torch.cuda.max_memory_allocated flattens and sorts every statistic).
        self._stats = stats or torch.cuda.memory_stats_as_nested_dict

    def read(self) -> tuple[int, int] | None:
        """``(allocated, reserved)`` peak bytes, or None off CUDA (nothing rather than a wrong number)."""
        if self.device is None:
            return None
        stats = self._stats(self.device)
        return int(stats["allocated_bytes"]["all"]["peak"]), int(stats["reserved_bytes"]["all"]["peak"])
