"""Position schemes: which position ids a sequence of length L is given.

- sequential: 0..L-1.
- randomized (Ruoss et al. ACL 2023): a sorted sample of L distinct positions from
  [0, max_position), drawn for every batch in training and evaluation alike, so the
  model meets the large positions of long sequences while training on short ones.
- offset: 0..L-1 shifted by one random offset in [0, max_position - L], the cheap
  control for randomized.
One draw is shared by the batch ([1, L]), which keeps bias masks at [1, H, L, L].
"""
from __future__ import annotations

import torch

SCHEMES = ("sequential", "randomized", "offset")


class PositionScheme:
    def __init__(self, scheme: str, max_position: int):
        if scheme not in SCHEMES:
            raise ValueError(f"train.positions={scheme!r} is not valid; choose one of {list(SCHEMES)}")
        if max_position is None or max_position < 1:
            raise ValueError(f"train.positions={scheme} needs train.max_position >= 1, got {max_position}")
        self.scheme, self.max_position = scheme, max_position

    def check(self, longest: int) -> None:
        """Refuse before training when a sequence of `longest` tokens cannot get distinct positions."""
        if longest > self.max_position:
            raise ValueError(f"train.positions={self.scheme} uses positions in [0, train.max_position="
                             f"{self.max_position}) but the longest evaluated sequence has {longest} tokens; "
                             f"set train.max_position >= {longest} (positions are never clamped)")

    def __call__(self, length: int, generator: torch.Generator) -> torch.Tensor:
        """-> position ids [1, L] (long) on the generator's device."""
        device = generator.device
        if self.scheme == "sequential":
            return torch.arange(length, device=device)[None]  # [1, L]
        if self.scheme == "randomized":
            chosen = torch.randperm(self.max_position, generator=generator, device=device)[:length]  # [L]
            return chosen.sort().values[None]  # [1, L]
        shift = torch.randint(0, self.max_position - length + 1, (1,), generator=generator, device=device)
        return (torch.arange(length, device=device) + shift)[None]  # [1, L]
