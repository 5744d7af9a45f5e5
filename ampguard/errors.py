"""The exceptions ampguard raises. Every one derives from :class:`AmpGuardError`."""

from __future__ import annotations

__all__ = [
    "AmpGuardError",
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "GuardStateError",
    "NonFiniteError",
    "RankDivergenceError",
    "refusal_reason",
]


class AmpGuardError(Exception):
    """Base class of every error ampguard raises on purpose."""


class GuardStateError(AmpGuardError, RuntimeError):
    """A method was called in a state where it cannot run (a call-order mistake).

    The message names what was called, in which state, and what to call instead.
    Nothing was changed: model, optimizer and scaler are as they were before the call.
    """


class NonFiniteError(AmpGuardError, FloatingPointError):
    """Training cannot go on: ``GuardConfig.max_consecutive_skips`` steps in a row were skipped.

    ``report`` is the :class:`~ampguard.StepReport` of the last skipped step. In a
    distributed run every rank raises it at the same step.
    """

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class RankDivergenceError(AmpGuardError):
    """Ranks disagree on step count, skip count, loss scale or parameters (``on_divergence="raise"``)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class BackendUnavailableError(AmpGuardError, ImportError):
    """An optional dependency is missing. The message names the pip extra that installs it."""


class BackendError(AmpGuardError, RuntimeError):
    """A backend cannot work in this process as it is set up (e.g. torch.distributed or Horovod
    not initialised). The message says what to call first."""


class CheckpointError(AmpGuardError, ValueError):
    """A checkpoint is refused: on save, its state is non-finite; on load, it was saved unhealthy, its
    optimizer state is non-finite, or the model's weights are not those it was saved with. The message
    names the tensors; nothing was written or changed. See docs/integrity.md."""


_NOTHING_LOADED = ("; nothing was loaded", ". Nothing was loaded", " Nothing was loaded")


def refusal_reason(error: BaseException, *, typed: bool = True) -> str:
    """A load's refusal as ``"<type>: <message>"`` (``typed=False``: the message alone) without its
    closing "nothing was loaded", for a caller that refused after something was loaded (a framework's
    or DCP's in-place load) and says so itself. The refusals of :mod:`ampguard.checkpoint` and
    :mod:`ampguard.integrity` end with one of those phrasings; other messages are kept whole."""
    reason = str(error).rstrip(".")
    for tail in _NOTHING_LOADED:
        reason = reason.removesuffix(tail)
    return f"{type(error).__name__}: {reason}" if typed else reason
