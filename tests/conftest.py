"""Test-wide hygiene, and fixtures every suite shares.

A guard that a test drops while forensics is armed keeps the process at the ``force_eager`` compile stance until
its Localizer is collected (``ampguard.forensics.compile._EagerWhileArmed``): its finalizer puts the stance back.
Collect such guards after each test, so a later compiled test does not find dynamo held at another test's stance.
Only when something is armed: no cost otherwise."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _drop_armed_forensics() -> Iterator[None]:
    yield
    from ampguard.forensics.compile import _EagerWhileArmed

    if _EagerWhileArmed.armed:
        gc.collect()


@pytest.fixture
def compile_state() -> Iterator[None]:
    """Dynamo reset, at the default stance, with no forensics counted as armed, for the test; the process's state put
    back after it. Another test's guard, armed by an anomaly and still alive, keeps ``_EagerWhileArmed`` counting it
    (a later arming then leaves the stance as it is: a compiled test would see its own armed hooks traced, and no
    force_eager); other tests' compiled frames (``nn.Sequential.forward``) count against the recompile limit, past
    which dynamo runs a frame eagerly."""
    from ampguard.forensics.compile import _EagerWhileArmed

    gc.collect()
    saved = _EagerWhileArmed.armed, _EagerWhileArmed.stance
    _EagerWhileArmed.armed, _EagerWhileArmed.stance = 0, None
    torch._dynamo.reset()
    stance = torch.compiler.set_stance("default")
    try:
        yield
    finally:
        gc.collect()  # the test's own guards, disarmed by their finalizers while the count is the test's
        if _EagerWhileArmed.stance is not None:  # still armed: the stance it set goes with it
            _EagerWhileArmed.stance.__exit__(None, None, None)
        stance.__exit__(None, None, None)
        torch._dynamo.reset()
        _EagerWhileArmed.armed, _EagerWhileArmed.stance = saved


@pytest.fixture
def compile_calls(compile_state: None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each call, during the test, of a function ``torch.compile`` compiled (the fused rule's tail,
    ``AMPGUARD_FUSED_RULE``): 1 where it ran compiled, 0 where forensics, armed by an anomaly, held compiled frames at
    force_eager (the tail then runs op by op). With :func:`compile_state`."""
    from ampguard.forensics.compile import _EagerWhileArmed

    calls: list[int] = []
    compile_ = torch.compile

    def counted(fn: Any, **kwargs: Any) -> Any:
        compiled = compile_(fn, **kwargs)
        return lambda *a: calls.append(int(not _EagerWhileArmed.armed)) or compiled(*a)

    monkeypatch.setattr(torch, "compile", counted)
    return calls


@pytest.fixture
def unscale_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times GradScaler ran its unscale/inf-check kernel (``_unscale_grads_``: both
    ``unscale_`` and the fused step's ``_check_inf_per_device`` go through it)."""
    calls: list[int] = []
    original = torch.amp.GradScaler._unscale_grads_

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", counting)
    return calls


@pytest.fixture(scope="module")
def hf_bench() -> Iterator[Any]:
    """``benchmarks/hf_classification.py`` as a module: its ``FAMILIES`` (GPT-2, Llama, Mistral, Qwen2, BERT, T5 at
    tiny sizes, from their ``transformers`` config classes), ``grow_qk`` and ``run``. Loaded under a name of its own
    (the benchmarks folder is not a package), and dropped after the module's tests."""
    import importlib.util
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_classification.py"
    spec = importlib.util.spec_from_file_location("hf_classification_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
