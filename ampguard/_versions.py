"""The versions of the optional packages ampguard was tested with (the framework integrations, torchao for fp8
monitoring), and the check that enforces them. A low module: core (ampguard.fp8) and integrations both use it."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import AmpGuardError

__all__ = ["EXTRA", "TESTED", "IntegrationVersionError", "check_version", "require"]

#: package -> (lowest tested version, first version not tested). pyproject's extras pin the same range.
TESTED: dict[str, tuple[str, str]] = {
    "accelerate": ("1.15", "1.17"),
    "transformers": ("5.17", "5.25"),
    "lightning": ("2.6", "2.7"),
    "torchao": ("0.18", "0.19"),
}

#: package -> the ampguard extra that installs it, where the names differ.
EXTRA: dict[str, str] = {"torchao": "fp8"}


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
    from .errors import BackendUnavailableError

    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        extra = EXTRA.get(package, package)
        raise BackendUnavailableError(f"{package} is not installed: pip install 'ampguard[{extra}]'") from exc
    check_version(package, str(getattr(module, "__version__", "0")))
    return module


def check_version(package: str, version: str) -> None:
    """Raise :class:`IntegrationVersionError` naming the tested range when ``version`` of ``package`` is outside it."""
    low, high = TESTED[package]
    extra = EXTRA.get(package, package)
    if not _key(low) <= _key(version) < _key(high):
        raise IntegrationVersionError(
            f"ampguard's {package} support is tested with {package} >={low},<{high}; {version} is installed. "
            f"Install a tested version: pip install 'ampguard[{extra}]' (or '{package}>={low},<{high}')."
        )
