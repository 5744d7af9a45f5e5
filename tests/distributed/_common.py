"""Helpers for the multi-rank tests: spawn real gloo ranks, train a tiny model, collect
what every rank ended with.

Rank bodies are module-level functions ``body(rank, world_size, **kwargs) -> picklable``;
:func:`spawn` runs them in ``world_size`` fresh processes with a loopback rendezvous and
returns their results by rank. Every wait is bounded: a hung rank fails the test, it never
hangs it.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ampguard
from ampguard import faults

SPAWN_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, outdir: str, body: Callable[..., Any], kwargs: dict) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    result: Any
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=__import__("datetime").timedelta(seconds=60),
        )
        try:
            result = ("ok", body(rank, world_size, **kwargs))
            # Free the body's DDP/FSDP objects (reference cycles included) and leave together
            # before the group goes: gloo can abort at exit otherwise. Bounded by the group timeout.
            gc.collect()
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which re-raises
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn(body: Callable[..., Any], world_size: int = 2, timeout: float = SPAWN_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``body(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks; results by rank."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry, args=(world_size, free_port(), outdir, body, kwargs), nprocs=world_size, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout}s")
        results, errors = [], []
        for r in range(world_size):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                errors.append(f"rank {r} failed:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial parameters on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def fsdp2_model(mesh: Any, seed: int = 0) -> torch.nn.Module:
    """:func:`tiny_model` under FSDP2: ``fully_shard`` on each Linear and on the root, over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(seed)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)  # different data per rank
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    out = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()  # collective (FSDP2)
        out.append(t.reshape(-1).float())
    return torch.cat(out)


def train(
    opt: Any,
    model: torch.nn.Module,
    rank: int,
    steps: int,
    *,
    micro_batches: int = 1,
    no_sync: Callable[[], Any] | None = None,
    before_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The guarded loop; returns what this rank ended with. A raised ampguard error is caught
    and reported with the step it happened at, so the parent can compare ranks."""
    error: tuple[str, int] | None = None
    for step in range(steps):
        try:
            for micro in range(micro_batches):
                x, y = batch(rank, step, micro)
                last = micro == micro_batches - 1
                ctx = no_sync() if (no_sync is not None and not last) else _null()
                with ctx:
                    with opt.autocast():
                        out = model(x)
                    loss = torch.nn.functional.mse_loss(out.float(), y) / micro_batches
                    opt.backward(loss)
            if before_step is not None:
                before_step(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        except ampguard.AmpGuardError as e:
            error = (type(e).__name__, step)
            break
    opt.flush()
    return summary(opt, model, error)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def summary(opt: Any, model: torch.nn.Module, error: tuple[str, int] | None = None) -> dict[str, Any]:
    hist = list(opt.history)
    return {
        "skipped": [r.step for r in hist if r.skipped],
        "nonfinite_ranks": {r.step: r.nonfinite_ranks for r in hist if r.skipped},
        "reasons": {r.step: r.reason for r in hist if r.skipped},
        "scale": opt.get_scale(),
        "params": flat_params(model),
        "anomalies": [(a.step, a.kind, a.ranks, a.detail) for a in opt.anomalies],
        "error": error,
        "backend": opt.backend.name,
        "grad_norms": [r.grad_norm for r in hist],
    }


STANDARD_FAULTS = {
    # step -> (fault, description); every fault on rank 1 only
    2: "loss",
    4: "grad before reduction",
    6: "grad after reduction",
}


def standard_faults(param: str, rank: int = 1) -> list[faults.Fault]:
    return [
        faults.loss("nan", steps=[2], ranks=[rank]),
        faults.grad(param, "inf", steps=[4], ranks=[rank]),
        faults.grad(param, "nan", steps=[6], ranks=[rank], after_reduction=True),
    ]


def assert_same_everywhere(results: list[dict[str, Any]], *, skipped: list[int], origin: int | None = None) -> None:
    """Every rank skipped exactly ``skipped``, ends with identical parameters and scale, and every
    skipped step's report names ``origin`` as the rank where the non-finite values came from."""
    for r, res in enumerate(results):
        assert res["skipped"] == skipped, f"rank {r} skipped {res['skipped']}, expected {skipped}"
        assert res["error"] is None, f"rank {r} raised {res['error']}"
    ref = results[0]
    for r, res in enumerate(results[1:], start=1):
        assert torch.equal(res["params"], ref["params"]), f"rank {r} parameters differ from rank 0's"
        assert res["scale"] == ref["scale"], f"rank {r} scale {res['scale']} != rank 0's {ref['scale']}"
        assert res["grad_norms"] == ref["grad_norms"] or _nan_equal(res["grad_norms"], ref["grad_norms"])
    assert torch.isfinite(ref["params"]).all()
    if origin is not None:
        for res in results:
            for step in skipped:
                assert res["nonfinite_ranks"][step] == (origin,), (
                    f"step {step} nonfinite_ranks={res['nonfinite_ranks'][step]}, expected ({origin},)"
                )


def _nan_equal(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def reports_and_params(guard: Any, model: torch.nn.Module) -> tuple[list[tuple[int, bool, Any]], torch.Tensor]:
    """A framework run's (step, skipped, nonfinite ranks) per guard report (none for the framework's own run,
    ``guard`` None), and its parameters flattened."""
    history = guard.history if guard is not None else []  # None: the framework's own run
    return ([(r.step, r.skipped, r.nonfinite_ranks) for r in history],
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def assert_one_rank_fault(results: list[dict[str, Any]], reports: str, bad_step: int, bad_rank: int) -> None:
    """Every rank ran in a world of ``len(results)`` (``results[r]["world_size"]``), skipped exactly ``bad_step`` in
    ``results[r][reports]`` and named ``bad_rank`` there."""
    for r, res in enumerate(results):
        assert res["world_size"] == len(results), (r, res["world_size"])
        assert [s for s, skipped, _ in res[reports] if skipped] == [bad_step], (r, res[reports])
        assert res[reports][bad_step][2] == (bad_rank,), r  # named on every rank
