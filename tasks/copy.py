"""Copy: output the input sequence. Length = n, the number of repeated or copied symbols.

The variants are Kazemnejad et al. 2023's copy tasks (NeurIPS; the generators are their
scripts/dataset_builders/make_copy_dataset.py, McGill-NLP/length-generalization), named as
their data splits are:

- cmc (copy multi char, the default): n symbols uniform over the alphabet -> the same n symbols.
  Their alphabet is 100 tokens (task.symbols=100).
- rsc (repeat single char): one uniform symbol a written n times -> a written n times.
- rdc (repeat double char): their prompt "Replace a with b in a a .. a" -> b b .. b, with a != b.
  Here the input is a, b, then a written n times (n + 2 tokens); the answer is b written n times.
- task.repeat=2 (their cmc2x and rsc2x splits) writes the answer twice: cmc2x as x NEXT x (their
  [NEXT] token between the copies, 2n + 1 tokens), rsc2x as a written 2n times (no separator, as
  theirs). They have no rdc2x split: rdc with repeat=2 is refused.

Their prompt words ("Copy:", "Replace", "with", "in") are constant tokens and are left out; the
layout is tasks.base's: [BOS] x SEP y. They score by greedy generation that stops at EOS, so the
model also says where the answer ends; task.eos=true does so here: [BOS] x SEP y EOS, EOS scored
(the default, false, scores y alone, its length given).

Tokens: 0..symbols-1, then NEXT (cmc with repeat=2 only), then EOS (task.eos=true only), then SEP,
BOS (and QUERY in the encoder layout). E.g. symbols=10 with eos: EOS 10, SEP 11, BOS 12 (QUERY 13);
cmc2x with eos: NEXT 10, EOS 11, SEP 12, BOS 13 (QUERY 14). The default (cmc, repeat=1, eos=false)
draws exactly the batches this task drew before the variants existed.
"""
from __future__ import annotations

import torch

from posbench.checks import Choice, Flag, Integer
from tasks.base import SequenceTask, filled, uniform_ids
from tasks.options import Transduction, check_layout

VARIANTS = ("cmc", "rsc", "rdc")


class Copy(Transduction):
    name = "copy"
    options = ("symbols", "variant", "repeat", "eos")

    def __init__(self, symbols: int = 10, default_length: int = 16, bos: bool = True, causal: bool = True,
                 variant: str = "cmc", repeat: int = 1, eos: bool = False):
        check_layout(self.name, default_length, bos, causal)
        self.symbols = Integer(2)("task.symbols", symbols, self.name)
        self.variant = Choice(VARIANTS)("task.variant", variant, self.name)
        self.repeat = Integer(1, 2)("task.repeat", repeat, self.name)
        eos = Flag()("task.eos", eos, self.name)
        if self.variant == "rdc" and self.repeat == 2:
            raise ValueError(f"{self.name}: task.repeat=2 with task.variant='rdc' is not valid: Kazemnejad et al. "
                             "have no 2x rdc task; use task.repeat=1, or task.variant=cmc or rsc with task.repeat=2")
        self.next = self.symbols if (self.variant, self.repeat) == ("cmc", 2) else None
        # TransductionTask's own __init__ only checks and stores `symbols` (done above); the alphabet
        # gains NEXT when cmc is written twice, so the layout is set up here with that alphabet
        SequenceTask.__init__(self, self.symbols + (self.next is not None), default_length, bos, causal, eos)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def input_length(self, length: int) -> int:
        return length + 2 if self.variant == "rdc" else length  # rdc: a, b, then a written n times

    def output_length(self, length: int) -> int:
        return self.repeat * length + (self.next is not None)

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.variant == "cmc":
            x = uniform_ids(generator, self.symbols, batch_size, length)  # [B, n]: the default's only draw
            y = x if self.next is None else torch.cat([x, filled(self.next, x, 1), x], dim=1)  # [B, m]
            return x, y
        a = uniform_ids(generator, self.symbols, batch_size, 1)  # [B, 1]
        if self.variant == "rsc":
            return a.expand(-1, length), a.expand(-1, self.repeat * length)  # [B, n], [B, repeat * n]
        b = (a + 1 + uniform_ids(generator, self.symbols - 1, batch_size, 1)) % self.symbols  # [B, 1], uniform != a
        return torch.cat([a, b, a.expand(-1, length)], dim=1), b.expand(-1, length)  # [B, n + 2], [B, n]
