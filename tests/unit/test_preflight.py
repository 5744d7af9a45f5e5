"""Preflight: a recommendation that, fed to wrap(), starts without skipped steps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import ampguard


def model_fn() -> torch.nn.Module:
    torch.manual_seed(0)
    # Gradients of order 1e2..1e3: fp16 overflows once the loss scale passes a few hundred.
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch_fn(i: int):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 16, generator=g)
    return x, 300.0 * torch.randn(8, 4, generator=g)


def optimizer_fn(params):
    return torch.optim.SGD(params, lr=1e-6)


def test_preflight_picks_a_scale_that_does_not_overflow_and_wrap_accepts_it():
    rec = ampguard.preflight(model_fn, batch_fn, optimizer_fn, steps=40, precision=("fp16",), device="cpu")
    (trial,) = rec.trials
    assert rec.precision == "fp16"
    assert trial.settle_steps > 5  # the probe scale 2**24 really overflowed first
    assert trial.overflow_rate < 0.05  # the scale settled; a late overflow may still back it off once
    assert rec.init_scale == trial.largest_clean_scale / 2
    assert trial.peak_memory_bytes is None  # CPU: nothing rather than a wrong number
    assert "init_scale" in str(rec)

    model = model_fn()
    opt = ampguard.wrap(optimizer_fn(model.parameters()), model=model, **rec.wrap_kwargs("cpu"))
    assert opt.get_scale() == rec.init_scale
    for i in range(30):
        x, y = batch_fn(100 + i)
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps == 0

    # Without the recommendation, GradScaler's default scale skips the first steps.
    model = model_fn()
    naive = ampguard.wrap(optimizer_fn(model.parameters()), model=model, precision="fp16")
    x, y = batch_fn(100)
    with naive.autocast():
        naive.backward(F.mse_loss(model(x).float(), y))
    naive.step()
    assert naive.step_was_skipped


def test_preflight_prefers_bf16_when_it_runs_and_reports_both():
    rec = ampguard.preflight(model_fn, batch_fn, optimizer_fn, steps=10, device="cpu")
    assert [t.precision for t in rec.trials] == ["fp16", "bf16"]
    assert rec.precision == "bf16" and rec.init_scale is None and rec.scaler_kwargs() == {}
    assert "needs no loss scaling" in rec.reason


def test_preflight_rejects_bad_arguments():
    with pytest.raises(ValueError, match="allowed: a sequence of 'fp16', 'bf16', 'fp32', 'fp8'"):
        ampguard.preflight(model_fn, batch_fn, optimizer_fn, precision=("fp4",))
    with pytest.raises(ValueError, match="steps=2"):
        ampguard.preflight(model_fn, batch_fn, optimizer_fn, steps=2)


def test_preflight_cli(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        def make_preflight():
            def model_fn():
                torch.manual_seed(0)
                return torch.nn.Linear(4, 2)
            def batch_fn(i):
                return torch.randn(8, 4), torch.randn(8, 2)
            return {"model_fn": model_fn, "batch_fn": batch_fn,
                    "optimizer_fn": lambda p: torch.optim.SGD(p, lr=0.01)}
    """))
    out = subprocess.run([sys.executable, "-m", "ampguard.cli", "preflight", "--script", f"{script}:make_preflight",
                          "--steps", "8", "--precision", "fp16,bf16", "--device", "cpu"],  # its batches are CPU
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "preflight recommendation: precision=bf16" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ampguard.cli", "preflight", "--script", f"{script}:nope"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no function 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_preflight_command_takes_the_script_directory_off_sys_path_again(tmp_path, capsys):
    # The script's directory is on sys.path while its factories run (a sibling import works), and only then.
    (tmp_path / "sibling.py").write_text("import torch\nMODEL = lambda: torch.nn.Linear(4, 2)\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        def make_preflight():
            def model_fn():
                import sibling
                torch.manual_seed(0)
                return sibling.MODEL()
            return {"model_fn": model_fn, "batch_fn": lambda i: (torch.randn(8, 4), torch.randn(8, 2)),
                    "optimizer_fn": lambda p: torch.optim.SGD(p, lr=0.01)}
    """))
    from ampguard import cli

    before = list(sys.path)
    try:
        rc = cli.main(["preflight", "--script", f"{tmp_path / 'train.py'}:make_preflight", "--steps", "5",
                       "--precision", "bf16", "--device", "cpu"])
        assert rc == 0, capsys.readouterr().err
        assert "preflight recommendation: precision=bf16" in capsys.readouterr().out
        assert sys.path == before
    finally:
        sys.path[:] = before
        sys.modules.pop("sibling", None)
