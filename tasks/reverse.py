"""Reverse: output the input symbols last to first. Length = number of input symbols."""
import torch

from tasks.base import TransductionTask


class Reverse(TransductionTask):
    name = "reverse"

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(1)
