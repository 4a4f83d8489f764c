"""Sort: output the input symbols in ascending order. Length = number of input symbols.

Tokens: 0..symbols-1, then EOS (task.eos=true only: the answer ends with it, scored), SEP, BOS
(and QUERY in the encoder layout); see tasks.options.Transduction.
"""
import torch

from tasks.options import Transduction


class Sort(Transduction):
    name = "sort"

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x.sort(dim=1).values
