"""The guard's loop calls inside a ``torch.compile``d function: torch's optimizer-compiling recipe
(``@torch.compile(fullgraph=False) def fn(): opt.step()``, pytorch.org/tutorials/recipes/compiling_optimizer)
and a compiled training step that runs the forward, ``opt.backward``, ``opt.step`` and ``opt.zero_grad``.

Before: Dynamo traced into the guard's host logic and failed (``InternalTorchDynamoError: NameError: name
'device' is not defined``, from ``marks_after_step``). Now each call runs eagerly (Dynamo breaks the
graph there) and the run is bit for bit the eager one: a tiny GPT-2 from ``transformers``' config, fp16
with a real GradScaler on the CPU whose first scale overflows (skipped steps and a back-off included).
Backends ``aot_eager`` and ``eager`` (no code generation: the same kernels as the eager run; inductor on
2 CPU cores compiles for over a minute, see test_compile.py).
``AMPGUARD_RECIPE_DEVICE=cuda`` runs it on CUDA (tests/gpu/test_gpu_recipes.py does, on the device).
"""

from __future__ import annotations

import os

import pytest
import torch

import ampguard

DEV = os.environ.get("AMPGUARD_RECIPE_DEVICE", "cpu")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.frameworks

STEPS = 6


def _run(mode: str) -> tuple[list[tuple[int, bool, float, str]], list[torch.Tensor]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(DEV)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler(DEV, init_scale=2.0**20), exporters=[])
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50, (2, 12), generator=g).to(DEV) for _ in range(STEPS)]

    def forward_backward(ids: torch.Tensor) -> None:
        with opt.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)

    if mode == "recipe":
        @torch.compile(fullgraph=False, backend="aot_eager")
        def fn() -> None:
            opt.step()

        for ids in batches:
            forward_backward(ids)
            fn()
            opt.zero_grad()
    elif mode == "train_step":
        @torch.compile(backend="eager")
        def train_step(ids: torch.Tensor) -> None:
            forward_backward(ids)
            opt.step()
            opt.zero_grad()

        for ids in batches:
            train_step(ids)
    else:
        for ids in batches:
            forward_backward(ids)
            opt.step()
            opt.zero_grad()
    history = [(r.step, r.skipped, r.loss_scale, repr(r.grad_norm)) for r in opt.history]  # repr: NaN == NaN
    opt.close()
    return history, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["recipe", "train_step"])
def test_compiled_calls_run_eagerly_bit_for_bit(mode):
    want_history, want = _run("eager")
    assert any(skipped for _, skipped, _, _ in want_history) and not all(s for _, s, _, _ in want_history)
    history, got = _run(mode)
    assert history == want_history
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_import_ampguard_does_not_import_dynamo():
    """The calls are marked for Dynamo lazily (``torch._disable_dynamo``, as torch's ``Optimizer.zero_grad``):
    ``torch.compiler.disable`` at class definition imported ``torch._dynamo`` with ``import ampguard`` (~1.1 s
    instead of ~0.1 s on this machine). A fresh interpreter, deterministic: which modules the import loaded."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, ampguard; print('torch._dynamo' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
