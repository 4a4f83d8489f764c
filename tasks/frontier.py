"""Tasks the 2024-26 positional-encoding papers (CoPE, PaTH, DeltaNet) use to show their claims;
mqar, the fifth, is associative recall with every pair queried (tasks/retrieval.py).

- flip_flop (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop Language Modeling"):
  instructions w (write), r (read), i (ignore), each followed by a bit; a read's bit is the last
  written bit. The paper's FFL(p) draws each instruction as i with probability p_i and as w or r
  with (1 - p_i) / 2 each; it trains on FFL(0.8) and tests out of distribution on sparse FFL(0.98)
  and dense FFL(0.1) (task.eval_p_ignore evaluates at another density). The sequence opens with a
  write, as the paper's, and here ends with a read, so every length has an answer to score.
  Length n = the instructions after the opening write: `[BOS] w b (op b)*n`, the n-th op a read.
  Scored on the read bits only (the paper scores only reads, the only deterministic tokens).
- selective_copy (Mamba's selective copying, Gu & Dao 2023; the CoPE paper): the input is n tokens,
  `min(content, n)` content symbols at uniform random positions, BLANK elsewhere; the answer is the
  content symbols in order. Length = n, the input tokens; a fixed `content` makes longer inputs
  sparser (more blanks per content symbol) and shorter ones denser.
- counting (the CoPE paper's task, as its released generator scripts/count_data_gen.py draws it):
  statements `v = 0`, `v ++` and `pass` over `variables` variables, then `print v`; the answer is
  v's value, the number of `v ++` since the last `v = 0`, at most `max_count` (10 there). Each
  statement is one token here. Statements are drawn with that generator's weights (set 1, pass 50,
  increment 7) and a uniform variable; where it would redraw (an increment of a variable not yet
  set, or past max_count) this one writes `pass`, and the first statement sets a variable (it
  redraws samples whose print finds none). The printed variable is uniform over those set.
  Length = n, the statements before `print v`.
- state_tracking (the word problem of S5 / A5, as in the PaTH and DeltaNet papers): n uniform
  elements of the group; the target at each position is the product of the elements so far.

Layouts: flip_flop and state_tracking lay out their own sequences (below); selective_copy and
counting are tasks.base.SequenceTask's `[BOS] x SEP y`. All five run in both layouts.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from posbench.checks import Choice, Flag, Integer, Real
from tasks.base import Batch, SequenceTask, Task, filled, uniform_ids
from tasks.options import check_layout

GROUPS = ("s5", "a5")


def check_common(task: Task, default_length, causal) -> None:
    """default_length and causal of the tasks that lay out their own sequences."""
    task.default_length = Integer(1)("task.default_length", default_length, task.name)
    task.causal = Flag()("task.causal", causal, task.name)


def check_length(task: Task, length: int) -> None:
    if length < 1:
        raise ValueError(f"{task.name}: length must be >= 1, got {length}")


class FlipFlop(Task):
    """Ids: bits 0, 1, then w 2, r 3, i 4, BOS 5 (QUERY 6 in the encoder layout).

    Causal: the model sees `[BOS] w b .. r` (2n + 2 tokens) and is scored where it predicts the bit
    after each r. Encoder: the whole sequence (2n + 3 tokens) with every read bit replaced by QUERY,
    scored at those positions. Training draws at p_ignore, evaluation (`sample`) at eval_p_ignore."""

    name = "flip_flop"
    WRITE, READ, IGNORE, BOS = 2, 3, 4, 5

    def __init__(self, p_ignore: float = 0.8, eval_p_ignore: float | None = None, default_length: int = 32,
                 causal: bool = True):
        self.p_ignore = Real(least=0, most=1)("task.p_ignore", p_ignore, self.name)
        self.eval_p_ignore = Real(least=0, most=1, null="p_ignore")("task.eval_p_ignore", eval_p_ignore, self.name)
        check_common(self, default_length, causal)
        self.query = None if self.causal else self.BOS + 1
        self.vocab_size = self.BOS + (1 if self.causal else 2)

    def params(self) -> dict:
        return {"p_ignore": self.p_ignore, "eval_p_ignore": self.eval_p_ignore, "causal": self.causal}

    def sequence_length(self, length: int) -> int:
        check_length(self, length)
        return 2 * length + 2 + (not self.causal)

    def train_sample(self, batch_size: int, length: int, train_length: int, generator: torch.Generator) -> Batch:
        return self.draw(batch_size, length, generator, self.p_ignore)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        p_ignore = self.p_ignore if self.eval_p_ignore is None else self.eval_p_ignore
        return self.draw(batch_size, length, generator, p_ignore)

    def draw(self, batch_size: int, length: int, generator: torch.Generator, p_ignore: float) -> Batch:
        check_length(self, length)
        device = generator.device
        u = torch.rand(batch_size, length + 1, generator=generator, device=device)  # [B, n + 1]
        ops = torch.where(u < p_ignore, self.IGNORE,
                          torch.where(u < p_ignore + (1 - p_ignore) / 2, self.WRITE, self.READ))  # [B, n + 1]
        ops[:, 0], ops[:, -1] = self.WRITE, self.READ
        bits = uniform_ids(generator, 2, batch_size, length + 1)  # [B, n + 1]
        step = torch.arange(length + 1, device=device)  # [n + 1]
        last_write = torch.where(ops == self.WRITE, step, 0).cummax(1).values  # [B, n + 1]
        is_read = ops == self.READ  # [B, n + 1]
        bits = torch.where(is_read, bits.gather(1, last_write), bits)
        seq = torch.cat([filled(self.BOS, ops, 1), torch.stack([ops, bits], 2).flatten(1)], 1)  # [B, 2n + 3]
        answer = F.pad(torch.stack([torch.zeros_like(is_read), is_read], 2).flatten(1), (1, 0))  # [B, 2n + 3]
        if self.causal:
            return Batch(inputs=seq[:, :-1], targets=seq[:, 1:], loss_mask=answer[:, 1:])  # [B, 2n + 2]
        return Batch(inputs=seq.masked_fill(answer, self.query), targets=seq, loss_mask=answer)


class SelectiveCopy(SequenceTask):
    """Ids: content symbols 0..symbols-1, BLANK, then SEP, BOS (QUERY)."""

    name = "selective_copy"
    options = ("symbols", "content")

    def __init__(self, symbols: int = 10, content: int = 16, default_length: int = 32, bos: bool = True,
                 causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        self.symbols = Integer(2)("task.symbols", symbols, self.name)
        self.content = Integer(1)("task.content", content, self.name)
        self.blank = self.symbols
        super().__init__(self.symbols + 1, default_length, bos, causal)

    def input_length(self, length: int) -> int:
        return length

    def output_length(self, length: int) -> int:
        return min(self.content, length)

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        k, device = self.output_length(length), generator.device
        order = torch.rand(batch_size, length, generator=generator, device=device).argsort(1)  # [B, n]
        kept = torch.zeros(batch_size, length, dtype=torch.bool, device=device).scatter_(1, order[:, :k], True)
        x = torch.where(kept, uniform_ids(generator, self.symbols, batch_size, length), self.blank)  # [B, n]
        return x, x[kept].view(batch_size, k)  # [B, n], [B, k]: boolean indexing keeps each row's order


class Counting(SequenceTask):
    """Ids: answers 0..max_count, `pass`, then per variable v: `v = 0` (SET), `v ++` (INC), `print v`
    (PRINT), in blocks of `variables`; then SEP, BOS (QUERY). x = the n statements, then `print v`."""

    name = "counting"
    data_bytes_per_token = 224.0  # measured 185 (posbench.guard)
    options = ("variables", "max_count")
    WEIGHTS = (1, 50, 7)  # set, pass, increment: the released generator's OP_WEIGHTS

    def __init__(self, variables: int = 3, max_count: int = 10, default_length: int = 64, bos: bool = True,
                 causal: bool = True):
        check_layout(self.name, default_length, bos, causal)
        self.variables = Integer(1)("task.variables", variables, self.name)
        self.max_count = Integer(1)("task.max_count", max_count, self.name)
        self.pass_id = self.max_count + 1
        self.set_id, self.inc_id, self.print_id = (self.pass_id + 1 + i * self.variables for i in range(3))
        super().__init__(self.print_id + self.variables, default_length, bos, causal)

    def input_length(self, length: int) -> int:
        return length + 1

    def output_length(self, length: int) -> int:
        return 1

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        device = generator.device
        u = torch.rand(batch_size, length, generator=generator, device=device) * sum(self.WEIGHTS)  # [B, n]
        op = (u >= self.WEIGHTS[0]).long() + (u >= sum(self.WEIGHTS[:2])).long()  # [B, n]: 0 set, 1 pass, 2 inc
        op[:, 0] = 0
        var = uniform_ids(generator, self.variables, batch_size, length)  # [B, n]
        which = F.one_hot(var, self.variables).bool()  # [B, n, V]
        sets, incs = which & (op == 0)[..., None], which & (op == 2)[..., None]  # [B, n, V]
        inc_total = incs.long().cumsum(1)  # [B, n, V]
        since_set = inc_total - torch.where(sets, inc_total, 0).cummax(1).values  # [B, n, V] incs since the last set
        was_set = sets.long().cumsum(1) > 0  # [B, n, V]
        kept = (incs & was_set & (since_set <= self.max_count)).any(-1)  # [B, n]
        tokens = torch.where(op == 0, self.set_id + var,
                             torch.where((op == 2) & kept, self.inc_id + var, self.pass_id))  # [B, n]
        asked = torch.multinomial(was_set[:, -1].float(), 1, generator=generator)  # [B, 1], a variable set
        value = since_set[:, -1].clamp(max=self.max_count).gather(1, asked)  # [B, 1]
        return torch.cat([tokens, self.print_id + asked], 1), value  # [B, n + 1], [B, 1]


class StateTracking(Task):
    """The word problem of S5 (or A5): the running product of n uniform group elements.

    Ids: an element is a permutation g of (0, 1, 2, 3, 4), written as the tuple (g(0), .., g(4)); its id
    is its rank in lexicographic order among the group's elements (120 for s5, the 60 even ones for a5;
    the identity is 0), then BOS. Composition: (g o h)(i) = g(h(i)). The target at position t is
    p_t = g_t o .. o g_2 o g_1 (g_1 acts first: p_t(i) = g_t(p_{t-1}(i)), p_0 = identity).

    Both layouts read `[BOS] g_1 .. g_n` (n + 1 tokens) and are scored on p_1..p_n at the positions of
    g_1..g_n (the target under BOS, the identity, is not scored); causal=false only lets every
    position see the whole sequence."""

    name = "state_tracking"

    def __init__(self, group: str = "s5", default_length: int = 16, causal: bool = True):
        self.group = Choice(GROUPS)("task.group", group, self.name)
        check_common(self, default_length, causal)
        perms = torch.tensor(list(itertools.permutations(range(5))))  # [120, 5] in lexicographic order
        if self.group == "a5":
            inversions = (perms[:, :, None] > perms[:, None, :]).triu(1).sum((1, 2))  # [120]
            perms = perms[inversions % 2 == 0]  # [60, 5]
        size = perms.shape[0]
        digits = 5 ** torch.arange(5)  # a permutation's code: its tuple read in base 5
        ids = torch.full((5 ** 5,), -1, dtype=torch.long).index_put_(((perms * digits).sum(1),), torch.arange(size))
        composed = perms[:, None, :].expand(size, size, 5).gather(2, perms[None].expand(size, size, 5))  # [G, G, 5]
        self.table = ids[(composed * digits).sum(-1)]  # [G, G]: table[g, h] = id of g o h
        self.identity = int(ids[(torch.arange(5) * digits).sum()])
        self.bos = size
        self.vocab_size = size + 1

    def params(self) -> dict:
        return {"group": self.group, "causal": self.causal}

    def sequence_length(self, length: int) -> int:
        check_length(self, length)
        return length + 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_length(self, length)
        table = self.table.to(generator.device)
        elements = uniform_ids(generator, self.bos, batch_size, length)  # [B, n]
        product, span = elements, 1  # product[t] = g_t o .. o g_{t-span+1} (clipped at g_1)
        while span < length:  # prefix scan: log2(n) batched steps
            product = torch.cat([product[:, :span], table[product[:, span:], product[:, :-span]]], 1)  # [B, n]
            span *= 2
        inputs = torch.cat([filled(self.bos, elements, 1), elements], 1)  # [B, n + 1]
        targets = torch.cat([filled(self.identity, elements, 1), product], 1)  # [B, n + 1]
        loss_mask = F.pad(torch.ones_like(elements, dtype=torch.bool), (1, 0))  # [B, n + 1]
        return Batch(inputs=inputs, targets=targets, loss_mask=loss_mask)
