"""Rules for one setting, shared by the config table (posbench.validate), the encodings
(`encoding.<param>`) and the tasks (`task.<param>`).

A rule is called as `rule(key, value)` and returns the value as the code uses it, or raises a
ValueError naming the key, the bad value and what is valid, e.g. `train.grad_clip=-1: must be > 0`.
Types are strict: OmegaConf hands over `x=abc` as the string 'abc', and a bool is an int in
Python, so `True` is refused where a count belongs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import ListConfig, OmegaConf

INT64_MAX = 2**63 - 1  # the largest integer torch takes (seeds, sizes, steps)


def shown(value) -> str:
    """The value as the user wrote it: strings quoted, OmegaConf lists as plain lists."""
    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value)
    return repr(value)


def refuse(key: str, value, valid: str, owner: str | None = None) -> None:
    prefix = f"{owner}: " if owner else ""
    raise ValueError(f"{prefix}{key}={shown(value)}: must be {valid}")


def refuse_choice(key: str, value, choices: str, owner: str | None = None) -> None:
    """The one refusal of a value outside its choices (Choice's, and the rules whose choices are not a tuple)."""
    prefix = f"{owner}: " if owner else ""
    raise ValueError(f"{prefix}{key}={shown(value)} is not valid; choose one of {choices}")


def bounds_text(least=None, most=None, above=None, below=None) -> str:
    """'>= 1', '> 0', 'in [0, 1]', 'in [0, 1)', ...; '' when unbounded."""
    low = (f"[{least}", f">= {least}") if least is not None else (f"({above}", f"> {above}") if above is not None \
        else None
    high = (f"{most}]", f"<= {most}") if most is not None else (f"{below})", f"< {below}") if below is not None \
        else None
    if low and high:
        return f"in {low[0]}, {high[0]}"
    return (low or high or ("",))[-1]


@dataclass(frozen=True)
class Integer:
    """An int (not a bool) in [least, most]; None allowed when `null` says what it means."""

    least: int = 0
    most: int = INT64_MAX
    null: str | None = None
    plural = "integers"
    type = int

    def bounds(self) -> str:
        return bounds_text(least=self.least, most=None if self.most == INT64_MAX else self.most)

    def text(self) -> str:
        """What is valid, for --help: 'an integer >= 1, or null (never)'."""
        return f"an integer {self.bounds()}" + (f", or null ({self.null})" if self.null else "")

    def __call__(self, key: str, value, owner: str | None = None) -> int | None:
        if value is None and self.null:
            return None
        or_null = f", or null ({self.null})" if self.null else ""
        bounds = bounds_text(least=self.least, most=None if self.most == INT64_MAX else self.most)
        if isinstance(value, bool) or not isinstance(value, int):
            refuse(key, value, f"an integer {bounds}{or_null}", owner)
        if value > self.most == INT64_MAX:
            refuse(key, value, f"<= {INT64_MAX} (torch's integers have 64 bits)", owner)
        if not self.least <= value <= self.most:
            refuse(key, value, bounds + or_null, owner)
        return value


@dataclass(frozen=True)
class Real:
    """A finite int or float (not a bool) within the bounds given; None allowed when `null` says what it means."""

    least: float | None = None
    most: float | None = None
    above: float | None = None
    below: float | None = None
    null: str | None = None
    plural = "numbers"
    type = float

    def bounds(self) -> str:
        return bounds_text(self.least, self.most, self.above, self.below)

    def text(self) -> str:
        return f"a number {self.bounds()}".rstrip() + (f", or null ({self.null})" if self.null else "")

    def __call__(self, key: str, value, owner: str | None = None) -> float | None:
        if value is None and self.null:
            return None
        bounds = bounds_text(self.least, self.most, self.above, self.below)
        or_null = f", or null ({self.null})" if self.null else ""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            refuse(key, value, f"a finite number {bounds}".rstrip() + or_null, owner)
        if ((self.least is not None and value < self.least) or (self.most is not None and value > self.most)
                or (self.above is not None and value <= self.above) or (self.below is not None and value >= self.below)):
            refuse(key, value, bounds + or_null, owner)
        return float(value)


@dataclass(frozen=True)
class Flag:
    """true or false (a string such as 'no' would read as True in Python); None allowed when `null` says what."""

    null: str | None = None
    type = bool

    def text(self) -> str:
        return "true or false" + (f", or null ({self.null})" if self.null else "")

    def __call__(self, key: str, value, owner: str | None = None) -> bool | None:
        if value is None and self.null:
            return None
        if not isinstance(value, bool):
            refuse(key, value, self.text(), owner)
        return value


@dataclass(frozen=True)
class Choice:
    """One of `options`; None allowed when `null` says what it means. The one check of a choice: settings,
    encoding and task parameters, command-line flags."""

    options: tuple
    null: str | None = None
    type = str

    def text(self) -> str:
        return " | ".join(map(str, self.options)) + (f", or null ({self.null})" if self.null else "")

    def __call__(self, key: str, value, owner: str | None = None):
        if value is None and self.null:
            return None
        if isinstance(value, bool) or value not in self.options:  # True == 1: never an option by accident
            or_null = f", or null ({self.null})" if self.null else ""
            refuse_choice(key, value, f"{list(self.options)}{or_null}", owner)
        return value


@dataclass(frozen=True)
class Text:
    """A string (a name, a path); None allowed when `null` says what it means. A number Hydra parsed from
    the command line (run_name=2024) is taken as its text."""

    null: str | None = None
    plural = "strings"
    type = str

    def text(self) -> str:
        return "a string" + (f", or null ({self.null})" if self.null else "")

    def __call__(self, key: str, value, owner: str | None = None) -> str | None:
        if value is None and self.null:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            refuse(key, value, self.text(), owner)
        return str(value)


@dataclass(frozen=True)
class Items:
    """A non-empty list whose every item passes `item`; None allowed when `null` says what it means."""

    item: Integer | Real | Text
    null: str | None = None
    empty: bool = False  # an empty list is valid too (logger.tags)
    type = list

    def text(self) -> str:
        bounds = self.item.bounds() if hasattr(self.item, "bounds") else ""
        return f"a {'' if self.empty else 'non-empty '}list of {self.item.plural} {bounds}".rstrip() \
            + (f", or null ({self.null})" if self.null else "")

    def example(self) -> str:
        return "[a,b]" if self.item.type is str else "[1,2]"

    def __call__(self, key: str, value, owner: str | None = None) -> list | None:
        if value is None and self.null:
            return None
        valid = f"a {'' if self.empty else 'non-empty '}list of {self.item.plural}"
        or_null = f", or null ({self.null})" if self.null else ""
        if not isinstance(value, (list, tuple, ListConfig)) or not (value or self.empty):
            refuse(key, value, valid + (f", e.g. {self.example()}" if self.empty else "") + or_null, owner)
        try:
            return [self.item(f"{key}[{i}]", item) for i, item in enumerate(value)]
        except ValueError as err:  # name the whole list as the user gave it, then the item
            raise ValueError(f"{key}={shown(value)}: {err}") from None
