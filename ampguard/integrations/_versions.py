"""The tested versions of the frameworks (re-exported: the table lives in the low module ``ampguard._versions``,
which core's fp8 monitoring uses too)."""

from __future__ import annotations

from .._versions import TESTED, IntegrationVersionError, require

__all__ = ["TESTED", "IntegrationVersionError", "require"]
