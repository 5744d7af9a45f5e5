"""``AmpGuardPrecision`` under a real ``lightning.Trainer`` on the six Hugging Face families (tiny, from
``benchmarks/hf_classification.py``'s builders), against Lightning's own fp16 ``MixedPrecision`` run of the same
module and data, both built as Lightning builds them on CUDA with the CPU in its place (``test_lightning``'s module
docstring), from a scale of 2**18 that the fp16 backward overflows as it comes (growth every two taken steps).
``accumulate_grad_batches=2`` and ``gradient_clip_val`` by norm (AdamW, foreach: Lightning clips no fused optimizer in
``MixedPrecision``). The same parameters after every batch, the same skips and the same loss scale, bit for bit."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from ampguard.integrations.lightning import AmpGuardPrecision

from .test_families_bitwise import FAMILY_NAMES, _same_bits
from .test_lightning import _one_thread  # noqa: F401  (the fixture: one CPU thread, as there)

pytestmark = pytest.mark.frameworks


class _Family(L.LightningModule):
    def __init__(self, build: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, _ = build(False)
        self.model.train()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


class _After(L.Callback):
    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.params.append([p.detach().clone() for p in pl_module.parameters()])


def _fit(build: Any, guarded: bool) -> tuple[Any, _After]:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2)
    plugin = (AmpGuardPrecision("16-mixed", device="cpu", scaler=scaler) if guarded
              else MixedPrecision("16-mixed", "cpu", scaler=scaler))
    module, after = _Family(build), _After()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, module.model.config.vocab_size, (24, 8), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, plugins=[plugin], enable_progress_bar=False,
                        logger=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[after], accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer.fit(module, train_dataloaders=loader)
    return plugin, after


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_plugin_is_lightnings_fp16_run_bit_for_bit(hf_bench, family):
    want_plugin, want = _fit(hf_bench.FAMILIES[family], guarded=False)
    got_plugin, got = _fit(hf_bench.FAMILIES[family], guarded=True)
    skipped = [r.skipped for r in got_plugin.guard.history]
    assert len(skipped) == 6 and any(skipped) and not all(skipped), skipped  # real overflows among the steps
    assert got_plugin.scaler.get_scale() == want_plugin.scaler.get_scale()
    assert len(got.params) == len(want.params) == 12
    for batch, (g_params, w_params) in enumerate(zip(got.params, want.params)):
        for i, (g, w) in enumerate(zip(g_params, w_params)):
            assert _same_bits(g, w), f"batch {batch}: parameter {i} differs"
