"""A ``torch.optim.Optimizer`` whose state is another optimizer's.

:class:`InnerOptimizerView` is the Optimizer surface of the guard: ``param_groups``, ``state``
and ``defaults`` are the inner optimizer's own objects, so LR schedulers, ``isinstance`` checks
and code that edits ``param_groups[i]["lr"]`` see the optimizer they already had. It also runs
the state-dict hooks users register on it, as ``torch.optim.Optimizer`` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["InnerOptimizerView"]


class InnerOptimizerView(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # torch.optim.Optimizer.__init__ is not called: it would build param_groups of its own.
        # These are the attributes its methods (hooks, profiling, repr) rely on.
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())
        self.optimizer = optimizer

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # the inner optimizer's own list
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: forward to the inner optimizer (e.g. Horovod's
        # synchronize()). Dunder and private names are not forwarded.
        if name.startswith("_") or name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled or deep-copied; save opt.state_dict() and rebuild "
                        "it with ampguard.wrap() + load_state_dict()")

    def _with_state_dict_hooks(self, save: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        state = save(self)
        for post in self._optimizer_state_dict_post_hooks.values():
            state = post(self, state) or state
        return state

    def _with_load_state_dict_hooks(self, load: Callable[[Any, dict[str, Any]], None],
                                    state_dict: dict[str, Any]) -> None:
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre(self, state_dict) or state_dict
        load(self, state_dict)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)
