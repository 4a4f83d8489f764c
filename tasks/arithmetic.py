"""Arithmetic tasks: compute a number from the input and write it as digits or one label.

From Kazemnejad et al. 2023 (the NoPE length-generalisation study): addition, summation, parity,
polynomial_evaluation. From Deletang et al. 2022 (the Chomsky hierarchy benchmark, also run by
Ruoss et al. 2023): binary_addition, modular_arithmetic, cycle_navigation. Each class says what
`length` means, its tokens (ids 0..alphabet-1; SEP, BOS and QUERY follow, see tasks.base) and
its answer: one label token, or a fixed-width sequence so every batch is rectangular.
"""
from __future__ import annotations

import torch

from posbench.checks import Flag, Integer
from tasks.base import SequenceTask, filled, uniform_ids
from tasks.options import check_layout


def add_digits(a: torch.Tensor, b: torch.Tensor, base: int) -> torch.Tensor:
    """Column addition of two numbers written most significant digit first:
    [B, n] + [B, n] -> the sum [B, n + 1], a leading 0 when nothing carries out."""
    digits, carry = [], torch.zeros_like(a[:, 0])  # [B]
    for column in range(a.shape[1] - 1, -1, -1):
        column_sum = a[:, column] + b[:, column] + carry  # [B]
        digits.append(column_sum % base)
        carry = column_sum // base
    digits.append(carry)
    return torch.stack(digits[::-1], dim=1)  # [B, n + 1]


class Addition(SequenceTask):
    """Add two n-digit decimal numbers (Kazemnejad et al. 2023).

    Length = n, the digits per operand. Input `a_1..a_n + b_1..b_n` (2n + 1 tokens), most
    significant digit first; operands are uniform over 0..10^n - 1, so they may start with 0s.
    Answer: the sum as n + 1 digits (a leading 0 when nothing carries out, so the width is fixed),
    most significant first, or least significant first with reverse_output (as Kazemnejad et al.).
    Tokens: 0-9 digits, 10 `+`.
    """

    name = "addition"
    data_bytes_per_token = 112.0  # measured about 80 (posbench.guard)
    options = ("reverse_output",)
    base = 10
    operands_least_significant_first = False

    def __init__(self, reverse_output: bool = False, default_length: int = 8, bos: bool = True,
                 causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        self.reverse_output = Flag()("task.reverse_output", reverse_output, self.name)
        super().__init__(self.base + 1, default_length, bos, causal)
        self.plus = self.base

    def input_length(self, length: int) -> int:
        return 2 * length + 1

    def output_length(self, length: int) -> int:
        return length + 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        a = uniform_ids(generator, self.base, batch_size, length)  # [B, n] most significant first
        b = uniform_ids(generator, self.base, batch_size, length)  # [B, n]
        total = add_digits(a, b, self.base)  # [B, n + 1]
        if self.operands_least_significant_first:
            a, b = a.flip(1), b.flip(1)
        x = torch.cat([a, filled(self.plus, a, 1), b], dim=1)  # [B, 2n + 1]
        return x, total.flip(1) if self.reverse_output else total


class BinaryAddition(Addition):
    """Add two n-bit binary numbers (Deletang et al. 2022), little-endian as in the paper.

    Length = n, the bits per operand. Input `a + b` (2n + 1 tokens), each operand least significant
    bit first and uniform over 0..2^n - 1. Answer: the sum as n + 1 bits, least significant first
    (a final 0 when nothing carries out). The paper instead splits L - 1 input bits at random
    between the operands and ends a variable-length sum with a termination token; equal widths keep
    every length, 1 included, a proper sum of two numbers. Tokens: 0, 1 bits, 2 `+`.
    """

    name = "binary_addition"
    data_bytes_per_token = 112.0  # measured 74 (posbench.guard)
    options = ()  # always least significant first
    base = 2
    operands_least_significant_first = True

    def __init__(self, default_length: int = 16, bos: bool = True, causal: bool = True):
        super().__init__(reverse_output=True, default_length=default_length, bos=bos, causal=causal)


class Summation(SequenceTask):
    """The sum of n digits modulo `modulus` (Kazemnejad et al. 2023: digits 0-9, mod 10).

    Length = n, the number of digits. Input: n digits uniform over 0..modulus-1.
    Answer: one label, the sum mod `modulus`. Tokens: 0..modulus-1, as digits and as labels.
    """

    name = "summation"
    options = ("modulus",)

    def __init__(self, modulus: int = 10, default_length: int = 16, bos: bool = True, causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        self.modulus = Integer(2)("task.modulus", modulus, self.name)
        super().__init__(self.modulus, default_length, bos, causal)

    def input_length(self, length: int) -> int:
        return length

    def output_length(self, length: int) -> int:
        return 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = uniform_ids(generator, self.modulus, batch_size, length)  # [B, n]
        return x, x.sum(1, keepdim=True) % self.modulus  # [B, 1]


class Parity(Summation):
    """The parity of n bits (Kazemnejad et al. 2023; Deletang et al.'s parity_check).

    Length = n, the number of bits. Answer: one label, 1 when the input holds an odd number of 1s,
    else 0. Tokens: 0, 1, as bits and as labels.
    """

    name = "parity"
    options = ()  # the modulus is 2

    def __init__(self, default_length: int = 16, bos: bool = True, causal: bool = True):
        super().__init__(modulus=2, default_length=default_length, bos=bos, causal=causal)


class PolynomialEvaluation(SequenceTask):
    """Evaluate a polynomial with n coefficients at a point, modulo a prime (Kazemnejad et al. 2023
    sum n terms c * x^d of random degrees, mod 10; here every degree below n appears once, mod 7).

    Length = n, the number of coefficients (degree n - 1). Input `v c_{n-1} .. c_1 c_0` (n + 1
    tokens): first the point v, then the coefficients from the highest power down, all uniform over
    0..modulus-1. Answer: one label, (c_{n-1} v^{n-1} + .. + c_1 v + c_0) mod `modulus`, with
    v^0 = 1 (so at v = 0 the answer is c_0). Tokens: 0..modulus-1 (point, coefficients, labels).
    """

    name = "polynomial_evaluation"
    data_bytes_per_token = 224.0  # measured 179 (posbench.guard)
    options = ("modulus",)

    def __init__(self, modulus: int = 7, default_length: int = 16, bos: bool = True, causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        self.modulus = Integer(2)("task.modulus", modulus, self.name)
        super().__init__(self.modulus, default_length, bos, causal)

    def input_length(self, length: int) -> int:
        return length + 1

    def output_length(self, length: int) -> int:
        return 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = uniform_ids(generator, self.modulus, batch_size, length + 1)  # [B, n + 1] point, coefficients
        point, value = x[:, 0], torch.zeros_like(x[:, 0])  # [B], [B]
        for coefficient in x[:, 1:].unbind(1):  # Horner: highest power first
            value = (value * point + coefficient) % self.modulus  # [B]
        return x, value[:, None]  # [B, 1]


class ModularArithmetic(SequenceTask):
    """Reduce an arithmetic expression of n terms modulo 5 (Deletang et al. 2022, the regular task
    without brackets).

    Length = n, the number of terms (numbers); the expression has 2n - 1 tokens, which is the
    paper's length. Grammar: `t_1 o_1 t_2 .. o_{n-1} t_n`, terms uniform over 0..4, operators
    uniform over {+, -, *}, evaluated with the usual precedence (every * first, then + and - from
    left to right), the result taken mod 5. Answer: one label, the residue. Tokens: 0-4 residues
    (terms and labels), 5 `+`, 6 `-`, 7 `*`.
    """

    name = "modular_arithmetic"
    modulus = 5

    def __init__(self, default_length: int = 16, bos: bool = True, causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        super().__init__(self.modulus + 3, default_length, bos, causal)
        self.plus, self.minus, self.times = self.modulus, self.modulus + 1, self.modulus + 2

    def input_length(self, length: int) -> int:
        return 2 * length - 1

    def output_length(self, length: int) -> int:
        return 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        terms = uniform_ids(generator, self.modulus, batch_size, length)  # [B, n]
        operators = self.plus + uniform_ids(generator, 3, batch_size, length - 1)  # [B, n - 1]
        x = torch.empty(batch_size, 2 * length - 1, dtype=torch.long, device=terms.device)  # [B, 2n - 1]
        x[:, 0::2], x[:, 1::2] = terms, operators
        # Left to right: `total` holds the finished additive terms, `product` the signed one being built.
        total, product = torch.zeros_like(terms[:, 0]), terms[:, 0]  # [B], [B]
        for i in range(1, length):
            operator, term = operators[:, i - 1], terms[:, i]  # [B], [B]
            times = operator == self.times
            total = torch.where(times, total, total + product)
            product = torch.where(times, product * term, torch.where(operator == self.plus, term, -term))
            total, product = total % self.modulus, product % self.modulus
        return x, ((total + product) % self.modulus)[:, None]  # [B, 1]


class CycleNavigation(SequenceTask):
    """Walk n steps on a cycle of 5 positions from position 0 (Deletang et al. 2022).

    Length = n, the number of moves, each uniform over {-1, 0, +1}. Answer: one label, the final
    position (sum of the moves mod 5). Tokens: 0-4 positions (labels), 5 move -1, 6 stay, 7 move +1.
    """

    name = "cycle_navigation"
    positions = 5

    def __init__(self, default_length: int = 16, bos: bool = True, causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        super().__init__(self.positions + 3, default_length, bos, causal)
        self.stay = self.positions + 1  # the move of token t is t - stay

    def input_length(self, length: int) -> int:
        return length

    def output_length(self, length: int) -> int:
        return 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stay - 1 + uniform_ids(generator, 3, batch_size, length)  # [B, n]
        return x, ((x - self.stay).sum(1, keepdim=True)) % self.positions  # [B, 1]
