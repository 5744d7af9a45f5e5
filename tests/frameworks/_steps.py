"""What :class:`ampguard.faults.Injection` needs of a guard, for an unguarded reference run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepHooks:
    """The step count, and the two moments a guarded step has (before the gradients are read,
    after the step). A reference loop calls :meth:`before` and :meth:`after` at the matching
    points of its framework, so a fault fires at the same step as in the guarded run."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count
        self._before: list[Any] = []
        self._after: list[Any] = []
        self._last_after: int | None = None

    @property
    def step_count(self) -> int:
        return self.count()

    def register_pre_unscale_hook(self, hook: Any) -> Any:
        return _Handle(self._before, hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return _Handle(self._after, hook)

    def before(self) -> None:
        for hook in list(self._before):
            hook(self.count())

    def after(self) -> None:
        """After an optimizer step (once per step: a framework's per-micro-batch hook may call it again)."""
        if self._last_after == self.count():
            return
        self._last_after = self.count()
        for hook in list(self._after):
            hook()


class _Handle:
    def __init__(self, hooks: list[Any], hook: Any) -> None:
        self.hooks, self.hook = hooks, hook
        hooks.append(hook)

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)
