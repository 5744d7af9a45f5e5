"""``ampguard demo``: a real multi-rank fp16 training with every guard firing at least once.

Two gloo ranks on the CPU by default (``--gpus``: every visible GPU over NCCL) train a small
character-level transformer on text that ships with Python (``pydoc_data.topics``), through
``ampguard.wrap``, with a schedule of faults from :mod:`ampguard.faults`:

- an overflow burst (a huge but finite activation that overflows fp16 in backward), which
  hysteresis and backoff absorb;
- a NaN in one rank's gradient only, before the all-reduce (attributed to that rank);
- a loss spike (one batch of random characters);
- a transient fault that a replay of the same batch does not reproduce.

Rank 0 shows the run live through :class:`ampguard.ConsoleExporter` (a table redrawn in place;
plain lines when the output is not a terminal, or with ``--plain``), while each rank serves
Prometheus metrics and writes TensorBoard and JSONL event logs under ``<out>/<run id>/``; at the
end the parent prints the summary of every rank's logs and writes the report picture.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]

WIDTH, HEADS, BLOCKS, SEQ, BATCH = 64, 4, 2, 64, 16


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="ampguard demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per rank (default: 120)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks on the CPU (default: 2; ignored with --gpus)")
    p.add_argument("--gpus", action="store_true", help="one rank per visible GPU, over NCCL")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                   help="autocast precision (default: fp16, with loss scaling)")
    p.add_argument("--no-faults", action="store_true", help="train without injected faults")
    p.add_argument("--port", type=int, default=9400,
                   help="Prometheus port of rank 0; rank R serves on port+R (default: 9400; 0 disables)")
    p.add_argument("--out", default="runs", help="directory for the run's logs (default: runs/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    return p


# ----------------------------------------------------------------------------- the model
def _model(vocab: int) -> Any:
    import torch

    class Block(torch.nn.Module):
        mask: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(WIDTH)
            self.attn = torch.nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
            self.ln2 = torch.nn.LayerNorm(WIDTH)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                           torch.nn.Linear(4 * WIDTH, WIDTH))
            self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            t = x.shape[1]
            x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class CharLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, WIDTH)
            self.pos = torch.nn.Parameter(torch.zeros(SEQ, WIDTH))
            self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
            self.ln = torch.nn.LayerNorm(WIDTH)
            self.head = torch.nn.Linear(WIDTH, vocab)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx) + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return CharLM()


def corpus() -> str:
    """English text that ships with CPython: the help topics behind ``help('topics')``."""
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def fault_plan(steps: int) -> dict[str, int]:
    """Steps at which each scheduled fault fires, scaled to the run's length."""
    at = {"overflow": 0.25, "one_rank_nan": 0.42, "loss_spike": 0.58, "transient": 0.75}
    return {k: max(1, int(v * steps)) for k, v in at.items()}


# ----------------------------------------------------------------------------- one rank
# Long (~70 lines): one rank of the demo, set-up to teardown, in the order a reader follows it.
def _rank_main(rank: int, world: int, args: argparse.Namespace, run_dir: str, init_file: str, run_id: str) -> None:
    # A rank's own (spawned) process: its environment says who it is and which run it is part of.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), AMPGUARD_RUN_ID=run_id)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ampguard
    from ampguard import faults
    from ampguard.exporters import ConsoleExporter, JsonlExporter, PrometheusExporter, TensorBoardExporter

    torch.set_num_threads(1)
    if args.gpus:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        text = corpus()
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        torch.manual_seed(args.seed)
        model = _model(len(chars)).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        exporters: list[Any] = [JsonlExporter(run_dir + "/", every_step=True),
                                TensorBoardExporter(os.path.join(run_dir, "tensorboard"), histogram_every=20),
                                ConsoleExporter(total_steps=args.steps, plain=True if args.plain else None)]
        if args.port:
            exporters.append(PrometheusExporter(port=args.port, addr="127.0.0.1"))
        spikes = ampguard.Spikes(loss_factor=1.3, grad_factor=20.0, warmup=10)
        config = ampguard.GuardConfig(hysteresis=2, spikes=spikes, max_consecutive_skips=25, consistency_every=20,
                                      forensics_window=200)
        inner = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
        opt = ampguard.wrap(inner, model=ddp, precision=args.precision, scaler=scaler, config=config,
                            exporters=exporters)
        plan = fault_plan(args.steps)
        if not args.no_faults:
            o = plan["overflow"]
            faults.inject(opt,
                          # a huge but finite activation before the output layer: the scaled gradient of
                          # the head overflows fp16 in backward (hysteresis 2: the 2nd one backs off)
                          faults.output("ln", 6.0e4, steps=range(o, o + 3)),
                          faults.grad("blocks.1.mlp.0.weight", "nan", steps=[plan["one_rank_nan"]], ranks=[1]),
                          faults.output("blocks.1", "nan", steps=[plan["transient"]], ranks=[0], transient=True))
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(args.steps):
            starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
            batch = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
            if not args.no_faults and step == plan["loss_spike"]:
                batch = torch.randint(0, len(chars), batch.shape, generator=g)  # noise: the loss jumps
            batch = batch.to(device)

            def closure(batch: torch.Tensor = batch, step: int = step, opt: ampguard.GuardedOptimizer = opt,
                        ddp: Any = ddp) -> None:
                opt.zero_grad(set_to_none=True)
                with opt.autocast():
                    logits = ddp(batch[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, len(chars)), batch[:, 1:].reshape(-1))
                opt.backward(loss, batch_id=f"rank{rank}:step{step}")

            opt.step(closure, replay=True)  # the guard may replay a non-finite step to localise it
            opt.zero_grad(set_to_none=True)
        opt.close()
        # Leave together and free DDP before the group goes: else gloo may abort at exit.
        dist.barrier()
        del opt, ddp, model, closure
        gc.collect()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the parent
def _wait(procs: Any) -> None:
    """Wait for the ranks (rank 0 draws the live view: :class:`ampguard.ConsoleExporter`)."""
    while not procs.join(timeout=0.5):
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 20:
        print("ampguard demo: error: --steps must be >= 20 (the fault schedule needs room)", file=sys.stderr)
        return 2
    import torch
    import torch.multiprocessing as mp

    if args.gpus:
        if not torch.cuda.is_available():
            print("ampguard demo: error: --gpus given but CUDA is not available", file=sys.stderr)
            return 2
        world = torch.cuda.device_count()
    else:
        world = args.ranks
        if world < 1:
            print("ampguard demo: error: --ranks must be >= 1", file=sys.stderr)
            return 2
    run_id = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.out) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"ampguard demo: {world} rank(s) ({'NCCL' if args.gpus else 'gloo, CPU'}), {args.precision}, "
          f"{args.steps} steps, faults {'off' if args.no_faults else 'on: ' + str(fault_plan(args.steps))}")
    print(f"  event logs + TensorBoard: {run_dir}/")
    if args.port:
        for r in range(world):
            print(f"  Prometheus, rank {r}: http://127.0.0.1:{args.port + r}/metrics")
    started = time.time()
    init_file = tempfile.mktemp(prefix="ampguard-demo-")  # file:// rendezvous; must not exist yet
    procs = mp.start_processes(_rank_main, args=(world, args, str(run_dir), init_file, run_id), nprocs=world,
                               join=False, start_method="spawn")
    try:
        _wait(procs)
    except KeyboardInterrupt:
        for p in procs.processes:
            p.terminate()
        raise
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    took = time.time() - started
    from . import runlog

    run = runlog.load_run(run_dir)
    summary = runlog.summary(run)
    print()
    print(runlog.format_summary(summary))
    picture = run_dir / "report.png"
    try:
        runlog.plot(run, picture)
        print(f"\nreport picture: {picture}")
    except Exception as exc:  # the picture is a bonus; the run and its logs are the result
        print(f"\nreport picture not written: {exc}")
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2, default=str))
    print(f"summary: {run_dir / 'summary.json'}   ({took:.0f} s)")
    return 0
