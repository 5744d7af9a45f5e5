"""Test-wide hygiene.

A guard that a test drops while forensics is armed keeps the process at the ``force_eager`` compile stance until
its Localizer is collected (``ampguard.forensics.compile._EagerWhileArmed``): its finalizer puts the stance back.
Collect such guards after each test, so a later compiled test does not find dynamo held at another test's stance.
Only when something is armed: no cost otherwise."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _drop_armed_forensics() -> Iterator[None]:
    yield
    from ampguard.forensics.compile import _EagerWhileArmed

    if _EagerWhileArmed.armed:
        gc.collect()
