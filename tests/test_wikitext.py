"""WikiText task: hub-format rows from the local release, tokenisers, both evaluation protocols,
perplexity by hand, the token cache, the error when no source works, and a real run. No network."""
import lzma
import math
import os
from pathlib import Path

import pytest
import torch

from tasks import text_data
from tasks.text_data import ByteTokenizer, Corpus, DataUnavailableError, WordTokenizer, release_rows
from tasks.wikitext import WikiText, WindowBatch, window_plan
from tests.helpers import ROOT, posbench, read_rows

SHARED = Path(os.environ.get("POSBENCH_WIKITEXT_DIR") or ROOT.parent / "shared" / "data" / "wikitext-2")

# A tiny release in the tokenized format: a blank line first, headings, <unk>, a blank line inside.
TINY = {
    "train": [" \n", " = Alpha = \n", " \n", " the cat sat on the mat . \n", " a <unk> cat ran . \n"],
    "valid": [" \n", " = Beta = \n", " the dog sat . \n", " \n", " the cat ran on the mat . \n"],
    "test": [" \n", " = Gamma = \n", " a dog . \n"],
}


def write_release(folder: Path, lines: dict[str, list[str]] = TINY, compress: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in lines.items():
        text = "".join(rows).encode("utf-8")
        name = folder / f"wiki.{split}.tokens"
        if compress:
            Path(f"{name}.xz").write_bytes(lzma.compress(text))
        else:
            name.write_bytes(text)
    return folder


def hub_row(line: str) -> str:
    return line if line.strip() else ""


@pytest.fixture(autouse=True)
def no_probe(monkeypatch):
    """The hub counts as reachable without the connection probe (text_data.hub_offline), so no test
    here opens a socket; the offline paths are tested in tests/test_bad_input.py."""
    monkeypatch.setattr(text_data, "hub_offline", lambda: None)


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach the hub fails the test (nothing here may touch the network)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the test tried to reach the Hugging Face hub")

    monkeypatch.setattr(text_data, "hub_rows", refuse)


# --- rows ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not (SHARED / "wiki.train.tokens.xz").exists() and not (SHARED / "wiki.train.tokens").exists(),
                    reason=f"no shared WikiText-2 copy at {SHARED} (set POSBENCH_WIKITEXT_DIR)")
def test_shared_copy_gives_the_hub_rows(no_hub, tmp_path):
    corpus = Corpus("wikitext-2-v1", SHARED, "byte", None)
    rows = {split: corpus.rows(split) for split in ("train", "validation", "test")}
    assert {k: len(v) for k, v in rows.items()} == {"train": 36718, "validation": 3760, "test": 4358}
    assert rows["train"][:2] == ["", " = Valkyria Chronicles III = \n"]  # README: ' \n' -> '', then the title
    assert rows["test"][:2] == ["", " = Robert <unk> = \n"]
    for split_rows in rows.values():
        assert all(r == "" or (r.strip() and r.endswith("\n")) for r in split_rows)
    assert sum(r != "" for r in rows["train"]) == 23767  # non-blank lines, README
    # The word-language-model counts of the README: 2,088,628 training tokens, 33,278 types.
    words = WordTokenizer.from_rows(rows["train"])
    assert words.vocab_size == 33278
    assert sum(len(r.split()) + 1 for r in rows["train"]) == 2088628


def test_release_rows_keep_hub_format_plain_and_xz(tmp_path):
    plain = write_release(tmp_path / "plain")
    packed = write_release(tmp_path / "xz", compress=True)
    expected = [hub_row(line) for line in TINY["valid"]]
    assert release_rows(plain / "wiki.valid.tokens") == expected
    assert release_rows(packed / "wiki.valid.tokens.xz") == expected
    assert expected[0] == "" and expected[1] == " = Beta = \n"


# --- tokenisers ---------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips():
    rows = ["", " caf\u00e9 \u2014 na\u00efve = \n", " x \n"]
    ids, counts = ByteTokenizer().encode(rows)
    assert counts is None and ids.dtype == torch.uint8
    assert ids.numel() == len("".join(rows).encode("utf-8"))  # bytes, not characters
    assert ByteTokenizer().decode(ids) == "".join(rows)


def test_word_tokenizer_round_trips_and_maps_unknown_words():
    train = [hub_row(line) for line in TINY["train"]]
    words = WordTokenizer.from_rows(train)
    assert words.vocab[:3] == ["<eos>", "=", "Alpha"]  # first appearance; the blank row gives <eos> first
    ids, counts = words.encode(train)
    assert ids.numel() == sum(len(r.split()) + 1 for r in train)
    assert words.decode(ids) == "".join(" ".join(r.split()) + "\n" for r in train)
    assert int(counts.sum()) == len("".join(train).encode("utf-8"))  # bytes of the text, blank rows ""
    ids, _ = words.encode([" the dog sat . \n"])  # "dog" never seen in training
    assert words.decode(ids) == "the <unk> sat .\n"


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match=r"task.tokenizer='bpe'.*\['byte', 'word'\]"):
        WikiText(tokenizer="bpe", cache_dir=None)
    with pytest.raises(ValueError, match=r"task.dataset='wikitext-3'.*wikitext-2-v1"):
        WikiText(dataset="wikitext-3", cache_dir=None)
    with pytest.raises(ValueError, match=r"task.eval_split='train'"):
        WikiText(eval_split="train", cache_dir=None)


# --- protocols ----------------------------------------------------------------------------------

@pytest.mark.parametrize("targets,length,stride", [(10, 4, 4), (10, 4, 1), (10, 4, 3), (8, 8, 2), (37, 6, 4)])
def test_window_plan_scores_each_target_once(targets, length, stride):
    starts, fresh = window_plan(targets, length, stride)
    seen = torch.zeros(targets, dtype=torch.long)
    for first, new in zip(starts.tolist(), fresh.tolist()):
        assert 0 <= first and first + length <= targets and 1 <= new <= length
        seen[first + length - new:first + length] += 1
    assert seen.tolist() == [1] * targets
    assert fresh[0] == length and (fresh[1:] <= stride).all()


@pytest.mark.parametrize("tokenizer", ["byte", "word"])
@pytest.mark.parametrize("length", [3, 8, 13])
def test_every_protocol_scores_every_validation_token_once(no_hub, tmp_path, tokenizer, length):
    task = WikiText(data_dir=write_release(tmp_path / "data"), tokenizer=tokenizer, eval_tokens=None,
                    cache_dir=tmp_path / "cache", stride=None, memory=5)
    stream = task.corpus.token_ids("validation").ids.long()
    counts = {protocol: torch.zeros(stream.numel(), dtype=torch.long)
              for protocol in ("non_overlapping", "sliding", "recurrent")}
    for batch in task.eval_batches(length, 0, 2, torch.Generator()):
        assert isinstance(batch, WindowBatch)
        if batch.protocol == "recurrent":  # consecutive segments of one stream, the last one shorter
            assert batch.inputs.shape[0] == 1 and batch.inputs.shape[1] <= length and batch.memory_length == 5
            assert batch.new_stream == (batch.stream_index[0, 0] == 1) and batch.loss_mask.all()
        else:
            assert batch.inputs.shape == (batch.inputs.shape[0], length) and batch.memory_length == 0
        assert torch.equal(batch.inputs, stream[batch.stream_index - 1])  # inputs precede targets by one
        assert torch.equal(batch.targets, stream[batch.stream_index])
        counts[batch.protocol].index_add_(0, batch.stream_index[batch.loss_mask],
                                          torch.ones(int(batch.loss_mask.sum()), dtype=torch.long))
    for protocol, seen in counts.items():  # every token but the first (never a target) exactly once
        assert seen.tolist() == [0] + [1] * (stream.numel() - 1), protocol


def test_eval_tokens_caps_the_range_and_keeps_each_token_once(no_hub, tmp_path):
    task = WikiText(data_dir=write_release(tmp_path / "data"), eval_tokens=50, cache_dir=None, stride=3)
    scored = {"non_overlapping": [], "sliding": []}
    for batch in task.eval_batches(16, 0, 4, torch.Generator()):
        scored[batch.protocol] += batch.stream_index[batch.loss_mask].tolist()
    assert sorted(scored["non_overlapping"]) == sorted(scored["sliding"]) == list(range(1, 51))
    with pytest.raises(ValueError, match="fewer than the window length 64; raise task.eval_tokens"):
        list(task.eval_batches(64, 0, 4, torch.Generator()))


def test_training_windows_are_seeded_slices_of_the_train_split(no_hub, tmp_path):
    task = WikiText(data_dir=write_release(tmp_path / "data"), cache_dir=None)
    train = task.corpus.token_ids("train").ids.long()
    a = task.sample(6, 10, torch.Generator().manual_seed(3))
    b = task.sample(6, 10, torch.Generator().manual_seed(3))
    assert torch.equal(a.inputs, b.inputs) and a.loss_mask.all() and a.inputs.shape == (6, 10)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])
    text = train.tolist()
    for window in torch.cat([a.inputs, a.targets[:, -1:]], 1).tolist():
        assert any(text[i:i + 11] == window for i in range(len(text) - 10))
    capped = WikiText(data_dir=tmp_path / "data", cache_dir=None, train_tokens=12)
    assert capped.sample(50, 11, torch.Generator().manual_seed(0)).inputs.eq(train[:11]).all()


# --- metrics ------------------------------------------------------------------------------------

def fake_logits(targets: torch.Tensor, vocab: int = 256) -> torch.Tensor:
    """A 'model' that gives the right byte probability 1/2 when it is 'a', else 1/4: the right
    logit is ln 255 (255 / (255 + 255) = 1/2) or ln 85 (85 / (85 + 255) = 1/4), the others 0."""
    right = torch.where(targets == ord("a"), math.log(255), math.log(85))  # [B, T]
    logits = torch.zeros(*targets.shape, vocab)  # [B, T, V]
    return logits.scatter(2, targets[..., None], right[..., None])


def test_perplexity_is_exp_of_the_mean_loss_by_hand(no_hub, tmp_path):
    # Validation text "abababababababab\n": 17 bytes, 16 targets: 7 x 'a' (1/2), 8 x 'b' + '\n' (1/4).
    # Mean loss = (7 ln 2 + 9 ln 4) / 16 = 25/16 ln 2 -> perplexity 2^(25/16), 25/16 bits per byte
    # (to rel=1e-5: batch_sums computes the loss in float32).
    data = write_release(tmp_path / "data", {"train": [" x \n"], "valid": ["ab" * 8 + "\n"], "test": [" y \n"]})
    task = WikiText(data_dir=data, eval_tokens=None, cache_dir=None, stride=2, position_bins=4, memory=3)
    sums: dict[str, float] = {}
    for batch in task.eval_batches(4, 0, 3, torch.Generator()):
        for key, value in task.batch_sums(fake_logits(batch.targets), batch).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    metrics = task.finalize(sums)
    for prefix in ("", "sliding_", "recurrent_"):
        assert metrics[f"{prefix}loss"] == pytest.approx(25 / 16 * math.log(2), rel=1e-5)
        assert metrics[f"{prefix}perplexity"] == pytest.approx(2 ** (25 / 16), rel=1e-5)
        assert metrics[f"{prefix}perplexity"] == pytest.approx(math.exp(metrics[f"{prefix}loss"]))
        assert metrics[f"{prefix}bits_per_byte"] == pytest.approx(25 / 16, rel=1e-5)
        assert metrics[f"{prefix}token_acc"] == 1.0  # the right logit is always the largest
    assert metrics["exact_match"] is None and metrics["eval_tokens"] == 16 and metrics["samples"] == 4
    # Non-overlapping windows of 4: targets "baba" three times, then "bab\n"; one position per bin:
    # 'b' (ln 4) at positions 0 and 2, 'a' (ln 2) at 1, and at 3 'a' three times and '\n' once.
    assert metrics["loss_by_position"] == pytest.approx(
        [math.log(4), math.log(2), math.log(4), (3 * math.log(2) + math.log(4)) / 4], rel=1e-5)


def test_word_bits_per_byte_use_the_bytes_of_the_text(no_hub, tmp_path):
    task = WikiText(data_dir=write_release(tmp_path / "data"), tokenizer="word", eval_tokens=None, cache_dir=None)
    sums: dict[str, float] = {}
    for batch in task.eval_batches(4, 0, 8, torch.Generator()):
        uniform = torch.zeros(*batch.targets.shape, task.vocab_size)  # loss ln V on every token
        for key, value in task.batch_sums(uniform, batch).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    metrics = task.finalize(sums)
    counts = task.corpus.token_ids("validation").byte_counts[1:]  # bytes of each scored target
    assert metrics["loss"] == pytest.approx(math.log(task.vocab_size))
    assert metrics["bits_per_byte"] == pytest.approx(counts.numel() * math.log2(task.vocab_size) / int(counts.sum()))


# --- cache and errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", ["byte", "word"])
def test_second_load_is_served_from_the_cache(no_hub, tmp_path, monkeypatch, tokenizer):
    data, cache = write_release(tmp_path / "data", compress=True), tmp_path / "cache"
    first = Corpus("wikitext-2-v1", data, tokenizer, cache).token_ids("validation")
    assert sorted(p.suffix for p in (cache / "wikitext").iterdir()) == (
        [".json", ".pt"] if tokenizer == "word" else [".pt"])

    def no_reading(path):
        raise AssertionError(f"read {path} although the cache holds it")

    monkeypatch.setattr(text_data, "release_rows", no_reading)
    second = Corpus("wikitext-2-v1", data, tokenizer, cache).token_ids("validation")
    assert torch.equal(first.ids, second.ids)
    # Another file content is another key: the stale cache is not used.
    write_release(data, {**TINY, "valid": [" \n", " new text \n"]}, compress=True)
    with pytest.raises(AssertionError, match="although the cache holds it"):
        Corpus("wikitext-2-v1", data, tokenizer, cache).token_ids("validation")


def test_hub_failure_without_data_dir_says_both_fixes(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("simulated: no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    task = WikiText(data_dir=None, cache_dir=None)  # byte: nothing is read until the first batch
    with pytest.raises(DataUnavailableError) as info:
        task.sample(2, 8, torch.Generator())
    message = str(info.value)
    assert "simulated: no network" in message and "task.data_dir=" in message
    assert "POSBENCH_WIKITEXT_DIR" in message and "go online" in message


def test_hub_path_asks_for_the_named_config_and_split_and_matches_the_files(monkeypatch, tmp_path):
    """Online, rows come from datasets.load_dataset("Salesforce/wikitext", <config>, split=...);
    stood in here by the tiny release's hub-format rows, they give the ids the files give."""
    import datasets

    calls = []
    splits = {"train": "train", "validation": "valid", "test": "test"}

    def hub(repo, config, split):
        calls.append((repo, config, split))
        return {"text": [hub_row(line) for line in TINY[splits[split]]]}

    monkeypatch.setattr(datasets, "load_dataset", hub)
    online = Corpus("wikitext-2-raw-v1", None, "word", None)
    offline = Corpus("wikitext-2-v1", write_release(tmp_path / "data"), "word", None)
    assert torch.equal(online.token_ids("validation").ids, offline.token_ids("validation").ids)
    assert ("Salesforce/wikitext", "wikitext-2-raw-v1", "validation") in calls
    assert ("Salesforce/wikitext", "wikitext-2-raw-v1", "train") in calls  # the word vocabulary


def test_data_dir_without_the_files_says_what_is_missing(tmp_path):
    write_release(tmp_path)
    with pytest.raises(DataUnavailableError, match=r"(?s)no wiki.train.raw.*set task.dataset=wikitext-2-v1"):
        WikiText(dataset="wikitext-2-raw-v1", data_dir=tmp_path, tokenizer="word", cache_dir=None)
    with pytest.raises(DataUnavailableError, match="is not a directory"):
        WikiText(data_dir=tmp_path / "nowhere", cache_dir=None)


# --- end to end ---------------------------------------------------------------------------------

def test_run_writes_perplexity_rows_and_the_position_figure(tmp_path):
    lines = {split: [" \n"] + [f" = Title {i} = \n" if i % 7 == 0 else " the quick brown fox jumps over the lazy "
                               f"dog number {i} . \n" for i in range(n)] for split, n in
             (("train", 200), ("valid", 40), ("test", 5))}
    data = write_release(tmp_path / "data", lines, compress=True)
    run_dir = tmp_path / "run"
    result = posbench("task=wikitext", "debug=smoke", f"task.data_dir={data}", f"task.cache_dir={tmp_path / 'cache'}",
                      "task.default_length=16", "task.eval_tokens=1000", "encoding=alibi", "task.memory=16",
                      f"hydra.run.dir={run_dir}", env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, timeout=240)
    rows = read_rows(run_dir)
    assert [r["eval_length"] for r in rows] == [16, 32]
    for row in rows:
        assert row["status"] == "ok" and row["task"] == "wikitext" and row["exact_match"] is None
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
        assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2))
        assert 1 < row["sliding_perplexity"] < 256 and row["eval_tokens"] == 1000
        assert 1 < row["recurrent_perplexity"] < 256 and row["task_params"]["memory"] == 16
        assert len(row["loss_by_position"]) == 16
        assert row["task_params"]["tokenizer"] == "byte" and row["task_params"]["data_dir"] == str(data)
    assert (run_dir / "loss_by_position.png").stat().st_size > 1000
    assert "recurrent_perplexity" in result.stdout


def test_recurrence_with_an_absolute_encoding_fails_before_training(tmp_path):
    from tests.helpers import compose_cfg
    from posbench.build import build

    data = write_release(tmp_path / "data")
    cfg = compose_cfg("task=wikitext", "encoding=learned", f"task.data_dir={data}", "task.memory=8",
                      f"task.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ValueError, match="segment recurrence needs a relative encoding.*'learned'"):
        build(cfg, torch.device("cpu"))
