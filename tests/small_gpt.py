"""A small GPT (embedding, pre-norm transformer blocks, head) that FSDP2 shards block by block: the model
the torch-backend tests train and its benchmark times."""

from __future__ import annotations

import torch
from torch import nn


class SmallGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(blocks))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token logits of every position, one row per token: (batch * length, vocab)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x).flatten(0, 1)
