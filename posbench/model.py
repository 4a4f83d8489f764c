"""A small pre-LN transformer (decoder by default) whose attention receives the encoding."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from posbench.attention import Attention, Backend
from posbench.encodings.base import Encoding


@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    causal: bool = True
    dropout: float = 0.0

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                             "pick sizes with d_model % n_heads == 0")


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, encoding: Encoding, backend: Backend):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, layer, encoding, backend, cfg.causal)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), pos))  # [B, L, D]
        return x + self.drop(self.mlp(self.norm2(x)))  # [B, L, D]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, encoding: Encoding, backend: Backend):
        super().__init__()
        backend.check(encoding)
        self.cfg = cfg
        self.encoding = encoding
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, encoding, backend) for i in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, module in self.named_modules():
            if not name.startswith("encoding"):  # encodings initialise their own parameters
                self._init(module)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.dim() == 2:
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids: [B, L] token ids, pos: [B', L] position ids -> logits [B, L, V]."""
        x = self.tok(ids)  # [B, L, D]
        if "embed" in self.encoding.hooks:
            x = self.encoding.embed(x, pos, ids)  # [B, L, D]
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, pos)  # [B, L, D]
        return self.head(self.norm(x))  # [B, L, V]
