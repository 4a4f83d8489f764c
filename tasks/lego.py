"""LEGO (Zhang et al. 2022, "Unveiling Transformers with LEGO"; one of Kazemnejad et al. 2023's
compositional tasks): resolve a shuffled chain of sign assignments.

Length = n, the number of clauses (= variables). A chain over n distinct variables drawn from
`variables` names: v_1 = s_1 1, v_i = s_i v_{i-1} (signs s_i uniform over {+, -}), i.e. clauses like
`a = +1; b = -a; c = +b`, presented in a uniformly shuffled order, three tokens each:
`variable sign operand` (operand: the token `1` or a variable). Answer: the value of each
clause's variable, in the shuffled input order, as `+` (+1) or `-` (-1): a sequence of n tokens.
Tokens: 0..variables-1 variable names, then `+`, `-`, `1`. Generated on the fly like every task
here; lengths above `variables` cannot be drawn and are refused.
"""
from __future__ import annotations

import torch

from posbench.checks import Integer
from tasks.base import SequenceTask, filled, uniform_ids
from tasks.options import check_layout


class Lego(SequenceTask):
    name = "lego"
    alphabet_setting = "variables"  # each sequence permutes all task.variables (posbench.guard)
    options = ("variables",)

    def __init__(self, variables: int = 32, default_length: int = 8, bos: bool = True, causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        self.variables = Integer(1)("task.variables", variables, self.name)
        super().__init__(self.variables + 3, default_length, bos, causal)
        self.plus, self.minus, self.one = self.variables, self.variables + 1, self.variables + 2

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length > self.variables:
            raise ValueError(f"{self.name}: length {length} needs {length} distinct variables but "
                             f"task.variables={self.variables}; raise task.variables to at least {length}")

    def input_length(self, length: int) -> int:
        return 3 * length

    def output_length(self, length: int) -> int:
        return length

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        device = generator.device
        draw = torch.rand(batch_size, self.variables, generator=generator, device=device)  # [B, V]
        chain = draw.argsort(1)[:, :length]  # [B, n] distinct variables v_1..v_n
        negative = uniform_ids(generator, 2, batch_size, length)  # [B, n] 1 where s_i = -
        values = (1 - 2 * negative).cumprod(1)  # [B, n] v_i = s_i v_{i-1}, v_1 = s_1
        operands = torch.cat([filled(self.one, chain, 1), chain[:, :-1]], dim=1)  # [B, n]
        clauses = torch.stack([chain, self.plus + negative, operands], dim=2)  # [B, n, 3]
        order = torch.rand(batch_size, length, generator=generator, device=device).argsort(1)  # [B, n]
        x = clauses.gather(1, order[..., None].expand(-1, -1, 3)).flatten(1)  # [B, 3n]
        y = torch.where(values.gather(1, order) > 0, self.plus, self.minus)  # [B, n]
        return x, y
