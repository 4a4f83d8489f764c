"""Stack manipulation (Deletang et al. 2022, a deterministic context-free task).

Length = L, the input tokens, as in the paper: an initial stack of s symbols over {a, b}, given
bottom to top, with s uniform over 1..max(1, L - 1), then L - s actions uniform over {POP,
PUSH a, PUSH b}, applied left to right (POP on an empty stack does nothing). Answer: the final
stack read top to bottom, then END, padded with END to the fixed width L + 1 (the stack never
holds more than L symbols). Only the stack and its first END are scored, as the paper's accuracy
mask does. Tokens: 0 `a`, 1 `b`, 2 POP, 3 PUSH a, 4 PUSH b, 5 END.
"""
from __future__ import annotations

import torch

from tasks.base import SequenceTask, uniform_ids
from tasks.options import check_layout

POP, PUSH_A, END = 2, 3, 5


class StackManipulation(SequenceTask):
    name = "stack_manipulation"
    data_bytes_per_token = 256.0  # measured 205 (posbench.guard)

    def __init__(self, default_length: int = 16, bos: bool = True, causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        super().__init__(END + 1, default_length, bos, causal)

    def input_length(self, length: int) -> int:
        return length

    def output_length(self, length: int) -> int:
        return length + 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        device = generator.device
        initial = 1 + uniform_ids(generator, max(1, length - 1), batch_size, 1)  # [B, 1] initial stack size s
        symbols = uniform_ids(generator, 2, batch_size, length)  # [B, L]
        actions = POP + uniform_ids(generator, 3, batch_size, length)  # [B, L]
        x = torch.where(torch.arange(length, device=device) < initial, symbols, actions)  # [B, L]
        # Every token is a push except POP: the initial symbols push themselves, PUSH a/b push a/b.
        stack = torch.zeros(batch_size, length, dtype=torch.long, device=device)  # [B, L] bottom first
        height = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        rows = torch.arange(batch_size, device=device)  # [B]
        for token in x.unbind(1):  # [B]; height < L before every push
            push = token != POP
            pushed = torch.where(token < POP, token, token - PUSH_A)  # [B]
            stack[rows[push], height[push]] = pushed[push]
            height = torch.where(push, height + 1, (height - 1).clamp(min=0))
        from_top = height[:, None] - 1 - torch.arange(length + 1, device=device)  # [B, L + 1] stack index
        y = torch.where(from_top >= 0, stack.gather(1, from_top.clamp(min=0)), END)  # [B, L + 1]
        return x, y

    def scored(self, y: torch.Tensor) -> torch.Tensor:
        return (y == END).cumsum(1) <= 1  # [B, L + 1] the stack and its first END
