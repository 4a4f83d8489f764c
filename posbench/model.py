"""A small transformer (pre-LN decoder by default) whose attention receives the encoding.

Its feed-forward activation, norm, biases, norm position and embedding scale are settings
(model.activation, norm, bias, norm_position, embed_scale), so a preset can take its paper's:
T5's RMSNorm, ReLU and no biases; Ruoss et al.'s post-LN encoder with scaled embeddings."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench import settings
from posbench.attention import Attention, Backend, PositionContext
from posbench.encodings.base import Encoding
from posbench.settings import NORM_POSITIONS, NORMS  # noqa: F401 (the choices, declared with the settings)

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}  # by name: settings.ACTIVATION_NAMES (tests/test_schema.py)
RMSNORM_EPS = 1e-6  # T5's layer_norm_epsilon
check_window = settings.Window()  # model.window's rule: check_window(key, value) -> the window


@dataclass
class ModelConfig:
    """The model: the task's vocabulary size, then the model.* settings (posbench.settings) with their types
    and defaults (model=small's); tests/test_schema.py holds the two equal."""

    vocab_size: int  # the task's
    d_model: int = 64  # the residual width
    n_layers: int = 3  # transformer layers
    n_heads: int = 4  # d_model % n_heads == 0
    mlp_ratio: int = 4  # the feed-forward width / d_model
    causal: bool = True  # true: a decoder; false: an encoder
    dropout: float = 0.0  # on the residual branches
    activation: str = "gelu"  # the feed-forward's (ACTIVATIONS)
    norm: str = "layernorm"  # or rmsnorm: T5's, no mean subtraction, no bias
    bias: bool = True  # false: none in the feed-forward and the norms (attention projections have none)
    norm_position: str = "pre"  # pre: x + f(norm(x)), a final norm; post: norm(x + f(x)), none (Vaswani et al.)
    embed_scale: bool = False  # token embeddings times sqrt(d_model) before the encoding's embed hook
    window: int | list[int | None] | None = None  # sliding window: keys with |i - j| < window; a list: per layer

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                             "pick sizes with d_model % n_heads == 0")
        self.window = check_window("model.window", self.window)

    def layer_window(self, layer: int) -> int | None:
        """The window of one layer: the setting, or its pattern repeated over the layers (None: global)."""
        return self.window[layer % len(self.window)] if isinstance(self.window, list) else self.window


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=RMSNORM_EPS)  # x / sqrt(mean(x^2) + eps) * weight
    return nn.LayerNorm(cfg.d_model, bias=cfg.bias)


STATE_OF_EVERY_TOKEN = ("state_init", "qkv", "layer_pass")  # hooks that read every token of the layer's forward


def recurrence_refusal(encoding: Encoding) -> str | None:
    """Why Transformer-XL segment recurrence cannot run `encoding`, or None."""
    if "embed" in encoding.hooks or not encoding.relative:
        return (f"segment recurrence needs a relative encoding without an embed hook (positions restart every "
                f"segment); encoding {encoding.name!r} is not one")
    held = [hook for hook in STATE_OF_EVERY_TOKEN if hook in encoding.hooks]
    if held:
        return (f"segment recurrence keeps earlier keys without their queries or position state; encoding "
                f"{encoding.name!r} reads every token of the layer's forward (hooks {held})")
    return None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, encoding: Encoding, backend: Backend):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg.d_model, cfg.n_heads, layer, encoding, backend, cfg.causal, cfg.layer_window(layer))
        self.norm2 = make_norm(cfg)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, hidden, bias=cfg.bias), ACTIVATIONS[cfg.activation](),
                                 nn.Linear(hidden, cfg.d_model, bias=cfg.bias))
        self.drop = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.norm_position == "pre"

    def forward(self, x: torch.Tensor, positions: PositionContext, memory: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, L, D]; memory: [B, M, D] earlier inputs of this block, attended as keys before x."""
        pre = self.pre_norm
        h = self.norm1(x) if pre else x  # [B, L, D]: what attention reads
        if memory is None:
            x = x + self.drop(self.attn(h, positions))  # [B, L, D]
        else:
            keys = torch.cat([self.norm1(memory) if pre else memory, h], dim=1)  # [B, M + L, D]
            x = x + self.drop(self.attn(h, positions, keys))  # [B, L, D]
        if not pre:
            x = self.norm1(x)  # [B, L, D]
        u = self.mlp(self.norm2(x) if pre else x)  # [B, L, D]
        encoding = self.attn.encoding[0]
        if "state_mlp" in encoding.hooks:
            positions.state = encoding.state_mlp(positions.state, u, self.attn.layer)
        return x + self.drop(u) if pre else self.norm2(x + self.drop(u))  # [B, L, D]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, encoding: Encoding, backend: Backend):
        super().__init__()
        self.cfg = cfg
        self.encoding = encoding
        self.check_backend(backend)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, encoding, backend) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()  # post-LN blocks end normed
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0
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
        """ids: [B, L] token ids, pos: [B', L] position ids (or [B', L, 2] on a grid) -> logits [B, L, V]."""
        pos = self.encoding.read_positions(pos)  # a 1-D encoding on a grid reads the raster index [B', L]
        x = self.tok(ids) * self.embed_scale  # [B, L, D]
        if "embed" in self.encoding.hooks:
            x = self.encoding.embed(x, pos, ids)  # [B, L, D]
        x = self.drop(x)
        positions = PositionContext(self.encoding, pos)  # a bias shared by the layers is built once
        if "state_init" in self.encoding.hooks:
            positions.state = self.encoding.state_init(pos, x)
        for block in self.blocks:
            x = block(x, positions)  # [B, L, D]
        return self.head(self.norm(x))  # [B, L, V]

    def check_backend(self, backend: Backend) -> None:
        backend.check(self.encoding)
        if self.cfg.window is not None and not backend.runs_windows:
            raise ValueError(f"backend={backend.name} does not run a sliding window (model.window={self.cfg.window}); "
                             "use backend=sdpa or eager")

    def use_backend(self, backend: Backend) -> None:
        """Every layer attends through `backend` from now on (auto's choice for an evaluation length)."""
        self.check_backend(backend)
        for block in self.blocks:
            block.attn.backend = backend

    def set_eval_chunk(self, queries: int | None) -> None:
        """Evaluation attends `queries` queries at a time in layers that form logits (None: all)."""
        for block in self.blocks:
            block.attn.eval_chunk = queries

    def check_recurrent(self) -> None:
        refusal = recurrence_refusal(self.encoding)  # the built instance's traits: rope + tener is not relative
        if refusal:
            raise ValueError(refusal)
        if not self.cfg.causal:
            raise ValueError("segment recurrence needs a causal model (model.causal=true)")

    def forward_recurrent(self, ids: torch.Tensor, memory: list[torch.Tensor] | None,
                          memory_length: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Transformer-XL segment recurrence (Dai et al. 2019): every block also attends to `memory`,
        its own inputs over the previous memory_length tokens, held without gradient.

        ids: [B, L]; memory: one [B, M, D] per block, or None at the start of a stream.
        -> logits [B, L, V] and the next memory (the last memory_length inputs of each block).
        Positions run 0..M-1 over the memory and M..M+L-1 over the segment: only their
        differences matter, which is why a relative encoding is required."""
        self.check_recurrent()
        if memory_length < 1:
            raise ValueError(f"memory_length={memory_length}: segment recurrence keeps at least one token")
        held = 0 if memory is None else memory[0].shape[1]
        key_pos = torch.arange(held + ids.shape[1], device=ids.device)[None]  # [1, M + L]: memory, then segment
        x = self.drop(self.tok(ids) * self.embed_scale)  # [B, L, D]
        positions = PositionContext(self.encoding, key_pos[:, held:], key_pos)
        kept = []
        for i, block in enumerate(self.blocks):
            layer_memory = None if memory is None else memory[i]
            inputs = x if layer_memory is None else torch.cat([layer_memory, x], dim=1)  # [B, M + L, D]
            kept.append(inputs[:, -memory_length:].detach())
            x = block(x, positions, layer_memory)  # [B, L, D]
        return self.head(self.norm(x)), kept  # [B, L, V]
