"""The framework versions each integration was tested with, and the check that enforces them."""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import AmpGuardError

__all__ = ["TESTED", "IntegrationVersionError", "require"]

#: package -> (lowest tested version, first version not tested). pyproject's extras pin the same range.
TESTED: dict[str, tuple[str, str]] = {
    "accelerate": ("1.15", "1.17"),
    "transformers": ("5.17", "5.25"),
    "lightning": ("2.6", "2.7"),
}


class IntegrationVersionError(AmpGuardError, ImportError):
    """The installed framework is outside the range this integration was tested with."""


def _key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = piece[: len(piece) - len(piece.lstrip("0123456789"))]  # leading digits only
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # 1.16.0rc1, 2.6.0.post0: stop at the first non-numeric part
            break
    return tuple(parts)


def require(package: str) -> Any:
    """Import ``package`` and check its version against :data:`TESTED`. Returns the module.
    Raises :class:`~ampguard.errors.BackendUnavailableError` when it is missing, and
    :class:`IntegrationVersionError` naming the supported range when it is outside it."""
    from ..errors import BackendUnavailableError

    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise BackendUnavailableError(f"{package} is not installed: pip install 'ampguard[{package}]'") from exc
    low, high = TESTED[package]
    version = str(getattr(module, "__version__", "0"))
    if not _key(low) <= _key(version) < _key(high):
        raise IntegrationVersionError(
            f"ampguard's {package} integration is tested with {package} >={low},<{high}; {version} is installed. "
            f"Install a tested version: pip install 'ampguard[{package}]' (or '{package}>={low},<{high}')."
        )
    return module
