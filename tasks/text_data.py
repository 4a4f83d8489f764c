"""WikiText rows, the byte and word tokenisers, and the on-disk cache of token ids.

Rows are exactly the Hugging Face `wikitext` rows: one `text` row per line of the release
file; a line whose `strip()` is empty becomes "", every other line keeps its leading space
and its trailing "\\n". Two sources give those rows:
- the hub: `datasets.load_dataset("Salesforce/wikitext", dataset, split=...)` (the bare
  name `wikitext` redirects there); `datasets` is imported only on this path;
- `data_dir`: a local copy of the release, `wiki.{train,valid,test}.tokens` (or `.raw` for
  the raw datasets), plain or `.xz`, read line by line as the hub's loading script did.
Neither is ever replaced by made-up text: when both fail, `DataUnavailableError` says how
to fix it.

Token ids are cached under `cache_dir` as `.pt` files keyed by dataset, source ("hub", or a
sha256 of the files read from data_dir), tokenizer and split, so a second run skips reading
and tokenising. Writes go through a temporary file and `os.replace`, so parallel sweep jobs
never read a half-written cache.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import socket
import warnings
from array import array
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import torch

from posbench.checks import Choice

HUB_REPO = "Salesforce/wikitext"
DATASETS = ("wikitext-2-v1", "wikitext-2-raw-v1", "wikitext-103-v1", "wikitext-103-raw-v1")
SPLITS = ("train", "validation", "test")
FILE_SPLIT = {"train": "train", "validation": "valid", "test": "test"}  # the release's file names
TOKENIZERS = ("byte", "word")
EOS, UNK = "<eos>", "<unk>"
CACHE_VERSION = 1  # bump when the cached format or the tokenisation changes


class DataUnavailableError(RuntimeError):
    """Neither the hub nor task.data_dir could provide the WikiText rows."""


HOW_TO_FIX = (
    "Fix it one of two ways:\n"
    "  1. point at a local copy of the release: task.data_dir=/path/to/wikitext-2 (or export "
    "POSBENCH_WIKITEXT_DIR=/path/to/wikitext-2), a folder holding wiki.train.tokens, wiki.valid.tokens and "
    "wiki.test.tokens (plain or .xz; wiki.*.raw for the raw datasets);\n"
    "  2. go online once (unset HF_DATASETS_OFFLINE and HF_HUB_OFFLINE) so `datasets` downloads and caches "
    f"{HUB_REPO}."
)


def release_rows(path: Path) -> list[str]:
    """The hub's rows of one release file: iterate lines like `open()` does, blank ones -> "".
    A file that is not UTF-8 text (or not .xz data, for a .xz name) -> DataUnavailableError naming
    it, the line where it breaks and what the folder should hold."""
    opener = lzma.open if path.suffix == ".xz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            return [row if row.strip() else "" for row in lines]
    except UnicodeDecodeError:
        problem = f"is not UTF-8 text ({first_undecodable(path, opener)})"
    except (lzma.LZMAError, EOFError) as err:  # a .xz name over other bytes, or a cut .xz file
        problem = f"is not a whole .xz file ({type(err).__name__}: {err})"
    except OSError as err:
        problem = f"cannot be read ({err.strerror or err})"
    stem = path.name.removesuffix(".xz")
    raise DataUnavailableError(
        f"task.data_dir={path.parent}: {path.name} {problem}. Expected the WikiText release's {stem}: plain UTF-8 "
        f"text, one line of the corpus per line{', compressed with xz' if path.suffix == '.xz' else ''}. Replace "
        "it with the release's file, or point task.data_dir (POSBENCH_WIKITEXT_DIR) at a good copy.") from None


def first_undecodable(path: Path, opener) -> str:
    """Where the file's first non-UTF-8 byte is: 'byte 0xce at line 3, column 1'."""
    with opener(path, "rb") as lines:
        for line_no, line in enumerate(lines, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return f"byte 0x{line[err.start]:02x} at line {line_no}, column {err.start + 1}"
    return "a character cut at the end of the file"


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
PROBE_SECONDS = 3.0  # one TCP connection to the hub; its failure means no network, not a slow one


def hub_offline() -> str | None:
    """Why the hub cannot be reached, found cheaply, or None: an HF_*_OFFLINE variable set, or one
    TCP connection to the hub's host that fails within PROBE_SECONDS (no DNS, no route). Without
    this, `datasets` retries each request for about 26 s before it gives up. Behind a proxy the
    direct connection says nothing, so nothing is probed."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{name}={os.environ[name]} is set"
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as err:
        return f"{host}:{port} cannot be reached: {err.strerror or type(err).__name__}"
    return None


@contextmanager
def offline_mode(datasets):
    """`datasets` and `huggingface_hub` in offline mode for the block (as HF_HUB_OFFLINE=1 would set
    them at import): a cached copy of the dataset still loads, a missing one fails at once."""
    import huggingface_hub.constants as hub_constants

    saved = [(module, getattr(module, "HF_HUB_OFFLINE", None)) for module in (datasets.config, hub_constants)]
    for module, _ in saved:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in saved:
            module.HF_HUB_OFFLINE = value


def hub_rows(dataset: str, split: str) -> list[str]:
    """The split's rows from the hub (or the `datasets` cache). Offline, found by hub_offline, it
    loads only from the cache, so a missing copy fails in a second, not after the hub's retries;
    every failure is one DataUnavailableError with both fixes (no chain of the hub's errors)."""
    offline = hub_offline()
    try:
        import datasets

        with offline_mode(datasets) if offline else nullcontext():  # no network: the cache only
            return list(datasets.load_dataset(HUB_REPO, dataset, split=split)["text"])
    except Exception as err:  # any failure (no package, offline, no cache) gets the same advice
        where = (f"the Hugging Face hub is offline ({offline}) and no cached copy loaded" if offline
                 else "the Hugging Face hub failed")
        raise DataUnavailableError(
            f"could not load {HUB_REPO} / {dataset} (split {split}): {where}, and task.data_dir is not set "
            f"(nor POSBENCH_WIKITEXT_DIR). {type(err).__name__}: {err}\n{HOW_TO_FIX}") from None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ByteTokenizer:
    """UTF-8 bytes of the rows joined as they are ("" rows vanish, the others end in "\\n")."""

    name = "byte"
    vocab_size = 256

    def encode(self, rows: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (ids [N] uint8, None): every token is one byte of text."""
        data = bytearray("".join(rows).encode("utf-8"))
        return torch.frombuffer(data, dtype=torch.uint8).clone(), None

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class WordTokenizer:
    """Whitespace words, `line.split() + ['<eos>']` for every row (blank rows give a lone `<eos>`),
    the convention of PyTorch's word_language_model behind the usual WikiText-2 token counts.
    The vocabulary is the training split's words in order of first appearance, plus `<unk>`
    (already a word of the tokenized release); words unseen in training map to `<unk>`."""

    name = "word"

    def __init__(self, vocab: list[str]):
        self.vocab = list(vocab)
        self.index = {word: i for i, word in enumerate(self.vocab)}
        if EOS not in self.index or UNK not in self.index:
            raise ValueError(f"a word vocabulary must hold {EOS} and {UNK}")
        self.vocab_size = len(self.vocab)

    @classmethod
    def from_rows(cls, rows: list[str]) -> WordTokenizer:
        index: dict[str, int] = {}
        for row in rows:
            for word in row.split():
                index.setdefault(word, len(index))
            index.setdefault(EOS, len(index))
        index.setdefault(UNK, len(index))
        return cls(list(index))

    def encode(self, rows: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids [N] int32, bytes [N] int32). A word stands for its UTF-8 bytes; `<eos>` for
        the rest of its row (the spaces and the newline), so a row's tokens sum to its bytes."""
        unk, eos = self.index[UNK], self.index[EOS]
        ids, sizes = array("i"), array("i")  # 4 bytes a token, not a Python list (WikiText-103: 10^8 tokens)
        for row in rows:
            words = row.split()
            ids.extend(self.index.get(word, unk) for word in words)
            ids.append(eos)
            word_bytes = [len(word.encode("utf-8")) for word in words]
            sizes.extend(word_bytes)
            sizes.append(len(row.encode("utf-8")) - sum(word_bytes))
        return int32_tensor(ids), int32_tensor(sizes)

    def decode(self, ids: torch.Tensor) -> str:
        """Words joined by one space, `<eos>` -> newline."""
        eos = self.index[EOS]
        lines, line = [], []
        for i in ids.tolist():
            if i == eos:
                lines.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.vocab[i])
        return "".join(lines) + " ".join(line)


def int32_tensor(values: array) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(values, dtype=np.int32).copy())  # [N]


@dataclass
class TokenIds:
    ids: torch.Tensor  # [N] uint8 (byte) or int32 (word)
    byte_counts: torch.Tensor | None  # [N] int32 bytes of text per token; None: one byte each


class Corpus:
    """One WikiText dataset from one source, tokenised one way, with its cache."""

    def __init__(self, dataset: str, data_dir: str | Path | None, tokenizer: str, cache_dir: str | Path | None):
        Choice(DATASETS)("task.dataset", dataset)
        Choice(TOKENIZERS)("task.tokenizer", tokenizer)
        self.dataset, self.tokenizer_name = dataset, tokenizer
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.cache_dir = Path(cache_dir).expanduser() / "wikitext" if cache_dir else None
        if self.data_dir is not None and not self.data_dir.is_dir():
            raise DataUnavailableError(f"task.data_dir={self.data_dir} is not a directory.\n{HOW_TO_FIX}")
        self._tokenizer: ByteTokenizer | WordTokenizer | None = None
        self._hashes: dict[str, str] = {}

    def source_file(self, split: str) -> Path:
        kind = "raw" if "raw" in self.dataset else "tokens"
        stem = f"wiki.{FILE_SPLIT[split]}.{kind}"
        for name in (stem, stem + ".xz"):
            if (self.data_dir / name).is_file():
                return self.data_dir / name
        present = sorted(p.name for p in self.data_dir.iterdir())
        hint = ""
        if kind == "raw" and any(".tokens" in name for name in present):
            hint = f"\nThis folder holds the tokenized release: set task.dataset={self.dataset.replace('-raw', '')}."
        raise DataUnavailableError(f"task.data_dir={self.data_dir} has no {stem} or {stem}.xz for dataset "
                                   f"{self.dataset}; it holds {present}.{hint}\n{HOW_TO_FIX}")

    def rows(self, split: str) -> list[str]:
        Choice(SPLITS)("task.split", split)
        if self.data_dir is None:
            return hub_rows(self.dataset, split)
        return release_rows(self.source_file(split))

    def source_key(self, split: str) -> str:
        """Names where the split's rows came from: the hub, or the checksum of the file read."""
        if self.data_dir is None:
            return "hub"
        if split not in self._hashes:
            self._hashes[split] = file_sha256(self.source_file(split))[:16]
        return self._hashes[split]

    def cache_path(self, split: str, suffix: str) -> Path | None:
        if self.cache_dir is None:
            return None
        key = self.source_key(split)
        if self.tokenizer_name == "word" and split != "train":  # ids depend on the training vocabulary too
            key += "-" + self.source_key("train")
        return self.cache_dir / f"{self.dataset}.{key}.{self.tokenizer_name}.v{CACHE_VERSION}.{split}{suffix}"

    @property
    def tokenizer(self) -> ByteTokenizer | WordTokenizer:
        if self._tokenizer is None:
            if self.tokenizer_name == "byte":
                self._tokenizer = ByteTokenizer()
            else:
                path = self.cache_path("train", ".vocab.json")
                vocab = read_cache(path, lambda p: json.loads(p.read_text(encoding="utf-8")))
                if vocab is None:
                    vocab = WordTokenizer.from_rows(self.rows("train")).vocab
                    write_cache(path, lambda p: p.write_text(json.dumps(vocab), encoding="utf-8"))
                self._tokenizer = WordTokenizer(vocab)
        return self._tokenizer

    def token_ids(self, split: str) -> TokenIds:
        path = self.cache_path(split, ".pt")
        cached = read_cache(path, lambda p: torch.load(p, weights_only=True))
        if cached is not None:
            return TokenIds(cached["ids"], cached["byte_counts"])
        tokenizer = self.tokenizer
        ids, byte_counts = tokenizer.encode(self.rows(split))
        write_cache(path, lambda p: torch.save({"ids": ids, "byte_counts": byte_counts}, p))
        return TokenIds(ids, byte_counts)


def read_cache(path: Path | None, load):
    if path is None or not path.is_file():
        return None
    try:
        return load(path)
    except Exception as err:  # a damaged cache is rebuilt, never trusted
        warnings.warn(f"ignoring unreadable cache {path}: {type(err).__name__}: {err}")
        return None


def write_cache(path: Path | None, save) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save(partial)
        os.replace(partial, path)
    except OSError as err:  # an unwritable cache costs speed, not correctness
        warnings.warn(f"could not write the token cache {path}: {err}")
