"""Checks of the options tasks.base's classes take as given (task.default_length, task.bos,
task.causal, task.symbols, task.eos): the task constructors call them first, so a bad
`task.<param>` is named before training instead of surfacing as a bare int() or comparison error."""
from __future__ import annotations

from posbench.checks import Flag, Integer
from tasks.base import TransductionTask


def check_layout(name: str, default_length, bos, causal) -> None:
    Integer(1)("task.default_length", default_length, name)
    Flag()("task.bos", bos, name)
    Flag()("task.causal", causal, name)


class Transduction(TransductionTask):
    """TransductionTask with its options checked (copy, reverse, sort). task.eos=true ends the answer
    with EOS, scored, as Kazemnejad et al. 2023 score by greedy generation that stops at EOS: the model
    must say where the answer ends. Ids: 0..symbols-1, then EOS (eos=true only), SEP, BOS (QUERY)."""

    options = ("symbols", "eos")

    def __init__(self, symbols: int = 10, default_length: int = 16, bos: bool = True, causal: bool = True,
                 eos: bool = False):
        check_layout(self.name, default_length, bos, causal)
        super().__init__(Integer(2)("task.symbols", symbols, self.name), default_length, bos, causal,
                         Flag()("task.eos", eos, self.name))
