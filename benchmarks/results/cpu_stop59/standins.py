"""Stop 59: the early skip flag and the payload's landing (``AMPGUARD_EARLY_SKIP``, CUDA only) forced onto a CPU
pipeline, their pinned buffers and external events stood in by CPU tensors and an event that never waits (on the CPU
nothing is on its way). Used by simearly.py (timing) and earlyplug.py (the usage patterns)."""

from typing import Any

import torch


class NoWaitEvent:
    """``torch.cuda.Event(external=True)``'s calls the flag and the landing make, on the CPU: nothing to wait for."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def force_early(pipe: Any) -> None:
    """Turn the early flag and the landing on for ``pipe`` (a non-fused optimizer's StepPipeline), as
    ``AMPGUARD_EARLY_SKIP=1`` does on CUDA."""
    pipe.early_skip = True
    pipe._new_flag = lambda: (torch.zeros(1, dtype=torch.bool), NoWaitEvent())
    pipe._new_slot = lambda size: (torch.zeros(size), NoWaitEvent())
