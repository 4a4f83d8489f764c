"""Copy: output the input sequence unchanged. Length = number of input symbols."""
import torch

from tasks.base import TransductionTask


class Copy(TransductionTask):
    name = "copy"

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x
