"""The hooks ampguard puts on a user's modules pickle as inert ones.

``torch.save(model)`` pickles the whole module, its hook dictionaries included. The guard's hooks are closures over
its instruments (the sentinel, the armed localizer, the fp8 monitor, FSDP2's pre-reduction check), and pickle cannot
take a local function: until stop 51 a whole-model save raised whenever one was on the model (with
``GuardConfig.sentinel`` always; after any non-finite step, for ``forensics_window`` clean steps). Each is registered
wrapped in :class:`Hook`, which calls through and pickles as :class:`Inert`: the loaded model computes the same,
with hooks that do nothing (no guard watches it). ``copy.deepcopy`` is unchanged (it copies the instruments too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Hook", "Inert"]


class Inert:
    """What a guard's hook is in a pickled model: it returns None (input and output unchanged)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __reduce__(self) -> tuple[type[Inert], tuple[()]]:
        return (Inert, ())


class Hook:
    """``fn``, a module hook of the guard's, called through; pickled as :class:`Inert`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[type[Inert], tuple[()]]:
        return (Inert, ())
