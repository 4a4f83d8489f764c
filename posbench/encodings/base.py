"""The Encoding base class: every positional encoding fills some of these hooks.

Order inside one attention layer (applied by `posbench.attention`, nowhere else):

    embed (model input) -> qk -> logits = q.k^T * scale + bias + key_term
    -> causal mask -> softmax -> prob -> p.V + value_term

Positions are always passed in explicitly, shaped [B', L] with B' either 1 (shared
by the batch) or B (one row per sequence), so that randomized positions, offsets
and interpolation need no change here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

HOOKS = ("embed", "qk", "bias", "key_term", "value_term", "prob")


@dataclass(frozen=True)
class ModelDims:
    """What an encoding may need to know about the model it sits in."""

    d_model: int
    n_heads: int
    n_layers: int
    max_positions: int  # largest position id + 1 the run will ever feed (train and eval)
    train_positions: int  # largest position id + 1 seen in training
    causal: bool = True
    vocab_size: int = 0  # for encodings that build word-dependent positions (complex_order)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Encoding(nn.Module):
    """Base class. Subclasses set `name`, `hooks` and `relative`, and override those hooks.

    Every hook defaults to "no change"; `hooks` declares which ones the subclass
    overrides so backends can refuse what they cannot run.
    """

    name: str = ""
    hooks: frozenset[str] = frozenset()
    relative: bool = False  # logits depend on i - j only (shift invariance)
    bias_layers_shared: bool = False  # bias(q_pos, k_pos, layer) is the same for every layer: built once

    def __init__(self, dims: ModelDims):
        super().__init__()
        unknown = set(self.hooks) - set(HOOKS)
        if unknown:
            raise TypeError(f"{type(self).__name__} declares unknown hooks {sorted(unknown)}; valid: {HOOKS}")
        self.dims = dims

    def params(self) -> dict:
        """The encoding's settings as recorded in every result row."""
        return {}

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        """Called by the runner before evaluating sequences of eval_positions tokens after
        training on up to train_positions: the one place for evaluation-time switches
        (RoPE scalings, table extensions). Default: nothing changes."""

    def logit_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [B, L, D] token embeddings, pos: [B', L], ids: [B, L] token ids -> [B, L, D]."""
        return x

    def qk(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [B, H, Lq, d], k: [B, H, Lk, d] -> the same shapes."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int) -> torch.Tensor | None:
        """-> [B', H, Lq, Lk], added to the scaled logits."""
        return None

    def key_term(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 layer: int) -> torch.Tensor | None:
        """Content-dependent logit term -> [B, H, Lq, Lk], added after scaling."""
        return None

    def prob(self, p: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int) -> torch.Tensor:
        """p: [B, H, Lq, Lk] softmax probabilities -> the same shape."""
        return p

    def value_term(self, p: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   layer: int) -> torch.Tensor | None:
        """-> [B, H, Lq, d], added to p.V."""
        return None

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params().items())


def relative_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every query/key pair: [B', Lq], [B', Lk] -> [B', Lq, Lk]."""
    return q_pos[:, :, None] - k_pos[:, None, :]


def check_choice(owner: str, key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {key}={value!r} is not valid; choose one of {list(choices)}")
