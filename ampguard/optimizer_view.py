"""A ``torch.optim.Optimizer`` whose state is another optimizer's.

:class:`InnerOptimizerView` is the Optimizer surface of the guard: ``param_groups``, ``state``
and ``defaults`` are the inner optimizer's own objects, so LR schedulers, ``isinstance`` checks
and code that edits ``param_groups[i]["lr"]`` see the optimizer they already had. It also runs
the state-dict hooks users register on it, as ``torch.optim.Optimizer`` does.
:func:`param_names` names the parameters of an optimizer, in ``param_groups`` order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .errors import GuardStateError

__all__ = ["InnerOptimizerView", "param_names"]


def param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> tuple[str, ...]:
    """Parameter names in ``param_groups`` order, as the user wrote them (no DDP ``module.``, no
    ``torch.compile`` ``_orig_mod.``); ``group{g}.param{i}`` where the model does not name one."""
    known: dict[int, str] = {}
    if model is not None:
        inner_model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        for name, p in inner_model.named_parameters():
            known.setdefault(id(p), name.replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", ""))
    return tuple(known.get(id(p), f"group{gi}.param{pi}")
                 for gi, group in enumerate(optimizer.param_groups) for pi, p in enumerate(group["params"]))


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

    @property
    def _is_accelerate_prepared(self) -> bool:
        # accelerate's prepare_optimizer() reads this of every optimizer it is given, before it
        # builds anything: the one moment a guard handed to accelerator.prepare() can be refused.
        raise GuardStateError(
            "accelerator.prepare() was given an optimizer that ampguard.wrap() already guarded: accelerate would "
            "step it with its own GradScaler calls and never see a skipped step. Prepare first, then guard: "
            "`optimizer = ampguard.wrap(accelerator.prepare(optimizer), accelerator=accelerator, model=model)` "
            "(wrap the plain optimizer: opt.optimizer). The optimizer was not prepared.")

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
