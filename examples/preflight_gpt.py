"""A preflight factory for ``ampguard preflight``: a small GPT on random tokens.

    ampguard preflight --script examples/preflight_gpt.py:make_preflight --steps 30

On CUDA the recommendation includes the peak memory of each precision against fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 8192, 512, 6, 8, 512, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.ln2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.proj(att)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def make_preflight() -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def model_fn() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT()

    def batch_fn(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    def optimizer_fn(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-4, fused=device == "cuda")

    return {"model_fn": model_fn, "batch_fn": batch_fn, "optimizer_fn": optimizer_fn}
