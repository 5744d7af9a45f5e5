"""Which precisions a device runs well: the rule table behind ``wrap()``'s hardware check."""

from __future__ import annotations

import warnings

import torch

from .errors import AmpGuardError

__all__ = ["UnsupportedPrecisionError", "check_precision", "device_capability"]


class UnsupportedPrecisionError(AmpGuardError, ValueError):
    """The device cannot run the requested precision (e.g. bf16 on a pre-Ampere GPU)."""


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability of ``device``, or None for a non-CUDA device."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def check_precision(precision: str, device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """Raise or warn when ``device`` cannot run ``precision`` well.

    | device            | fp16                              | bf16                          |
    |-------------------|-----------------------------------|-------------------------------|
    | CUDA cc >= 8.0    | ok                                | ok                            |
    | CUDA 7.0 <= cc<8  | ok                                | error: no bf16 tensor cores   |
    | CUDA cc < 7.0     | warning: no fp16 tensor cores     | error                         |
    | CPU               | ok (slow matmuls; prefer bf16)    | ok                            |

    ``capability`` overrides the probed one (tests fake devices with it).
    """
    if precision == "fp32":
        return
    if capability is None:
        capability = device_capability(device)
    if capability is None:
        return
    if precision == "bf16" and capability < (8, 0):
        raise UnsupportedPrecisionError(
            f"precision='bf16' needs a CUDA device of compute capability >= 8.0 (Ampere or newer); "
            f"{device} has {capability[0]}.{capability[1]}, where bf16 runs in slow emulation or not at "
            "all. Use precision='fp16' (loss scaling) or 'fp32'."
        )
    if precision == "fp16" and capability < (7, 0):
        warnings.warn(
            f"precision='fp16' on {device} (compute capability {capability[0]}.{capability[1]} < 7.0): "
            "no fp16 tensor cores, so mixed precision will save memory but not time.",
            RuntimeWarning,
            stacklevel=3,
        )
