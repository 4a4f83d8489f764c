"""Silent or cryptic input (issue 24): a checkpoint that is no checkpoint, a garbage WikiText file,
the hub offline, torn lines on resume, a binary multirun.yaml and a config.yaml of another layout.
Each gets one message that names the file or the setting, before training where there is training.
Nothing here touches the network: the hub and the connection probe are stood in for."""
import json
import os
import random
import socket

import pytest
import torch

from posbench import runner
from posbench.report import main as report_main
from posbench.report import write_report
from posbench.results import ROW_FILE, SCHEMA, RowWriter, read_rows
from posbench.rundir import read_status
from posbench.sweeps import sweep_progress
from tasks import text_data
from tasks.text_data import DataUnavailableError, hub_rows
from tests.helpers import compose_cfg, posbench, write_wikitext_release
from tests.test_report import write_run
from tests.test_report_robust import add_status

TINY = ("debug=smoke", "encoding=rope", "task=copy", "threads=1", "device=cpu", "train.save_checkpoint=false")
BINARY = b"\xce\xff\x00\x12 not text\n\x80\x81\x82\n"


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("training started: the bad input was not refused before it")

    monkeypatch.setattr(runner, "train", refuse)


# ---- 1. train.init_from at a file that is no checkpoint ----------------------------------------------

# torch 2.13's weights-only unpickler raises KeyError, not UnpicklingError, where the first byte is a
# memo lookup: "h" (BINGET: KeyError: 101 from "hello"), "j" (LONG_BINGET: KeyError: <the next 4 bytes>)
@pytest.mark.parametrize("content", [b"hello, these are my notes\n", b"j" + random.Random(0).randbytes(4095),
                                     random.Random(1).randbytes(4096)], ids=["text", "random-keyerror", "random"])
def test_init_from_a_text_or_random_file_names_the_setting(content, no_training, tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(content)
    try:  # what torch itself raises here, whatever the version: its words stay in the message
        torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001
        error = f"{type(err).__name__}: {' '.join(str(err).split())[:20]}" if type(err) is KeyError else \
            type(err).__name__
    with pytest.raises(ValueError) as info:
        runner.run(compose_cfg(*TINY, f"train.init_from={path}"), tmp_path / "run")
    message = str(info.value)
    assert message.startswith(f"train.init_from={path}: not a posbench checkpoint (torch.load failed: "), message
    assert "torch.load failed: " in message and error in message and "truncated, corrupted" in message
    assert info.value.__cause__ is None and "\n" not in message  # one line, the original error's words in it
    assert read_status(tmp_path / "run")["phase"] == "build"  # refused before training


# ---- 2. a garbage file in task.data_dir ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["wiki.train.tokens", "wiki.valid.tokens.xz"])
def test_a_binary_file_in_data_dir_is_named_with_what_was_expected(name, no_training, tmp_path):
    data = write_wikitext_release(tmp_path / "data")
    if name.endswith(".xz"):  # the folder holds the .xz in place of the plain file
        (data / "wiki.valid.tokens").unlink()
    (data / name).write_bytes(b" the cat sat .\n" + BINARY)  # garbage from line 2 on
    cfg = compose_cfg(*TINY, "task=wikitext", f"task.data_dir={data}", "task.cache_dir=null")
    with pytest.raises(DataUnavailableError) as info:
        runner.run(cfg, tmp_path / "run")
    message = str(info.value)
    if name.endswith(".xz"):
        assert f"task.data_dir={data}: {name} is not a whole .xz file (LZMAError: " in message
        assert "Expected the WikiText release's wiki.valid.tokens: plain UTF-8 text, one line of the corpus " \
               "per line, compressed with xz" in message
    else:
        assert f"task.data_dir={data}: {name} is not UTF-8 text (byte 0xce at line 2, column 1)" in message
        assert f"Expected the WikiText release's {name}: plain UTF-8 text" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # not a bare UnicodeDecodeError


# ---- 3. no WikiText variable or data_dir, offline -------------------------------------------------------

@pytest.fixture
def offline_hub(monkeypatch):
    """datasets.load_dataset raising what it raises offline, recording whether offline mode was on; the
    connection probe refused as a machine without DNS refuses it, at once."""
    import datasets
    import huggingface_hub.constants as hub_constants

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE))
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (OfflineModeIsEnabled)")

    def no_dns(address, timeout=None):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(text_data.socket, "create_connection", no_dns)
    for name in (*text_data.OFFLINE_VARIABLES, *text_data.PROXY_VARIABLES, "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return calls


def one_clear_message(err: DataUnavailableError) -> str:
    message = str(err)
    assert err.__cause__ is None and err.__suppress_context__  # no chain of the hub's own errors
    assert "task.data_dir is not set (nor POSBENCH_WIKITEXT_DIR)" in message and "Fix it one of two ways" in message
    assert "ConnectionError: Couldn't reach 'Salesforce/wikitext'" in message
    return message


def test_offline_variable_fails_fast_with_one_message(offline_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(text_data.socket, "create_connection", lambda *a, **k: pytest.fail("probed while offline"))
    with pytest.raises(DataUnavailableError) as info:
        hub_rows("wikitext-2-v1", "train")
    assert "the Hugging Face hub is offline (HF_HUB_OFFLINE=1 is set) and no cached copy loaded" \
        in one_clear_message(info.value)
    assert offline_hub == [(True, True)]


def test_no_network_loads_from_the_cache_only_and_says_why(offline_hub):
    import datasets
    import huggingface_hub.constants as hub_constants

    before = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    task = text_data.Corpus("wikitext-2-v1", None, "byte", None)
    with pytest.raises(DataUnavailableError) as info:
        task.token_ids("train")
    message = one_clear_message(info.value)
    assert "the Hugging Face hub is offline (huggingface.co:443 cannot be reached: Name or service not known)" \
        in message
    assert offline_hub == [(True, True)]  # the cache only: no retries against a hub out of reach
    assert (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE) == before  # restored


# ---- 4. torn lines in results.jsonl on resume --------------------------------------------------------

def row(run_id: str, length: int) -> dict:
    return {key: None for key in SCHEMA} | {"run_id": run_id, "status": "ok", "eval_length": length}


def test_resume_keeps_unreadable_lines_and_warns_with_file_and_line(tmp_path):
    file = tmp_path / ROW_FILE
    good = json.dumps(row("r1", 2))
    torn = json.dumps(row("r1", 4))[:-30].encode()
    file.write_bytes(good.encode() + b"\n" + BINARY[:11] + b"\n" + b'{"a": 1}\n' + torn)  # a kill cut the last row
    with pytest.warns(UserWarning) as warned:
        writer = RowWriter(tmp_path, keep=lambda r: r.get("run_id") == "r1" and r.get("status") == "ok")
    messages = [str(w.message) for w in warned]
    assert [m.split(": ")[0] for m in messages] == [f"{file}:2", f"{file}:3", f"{file}:4"]
    assert "not UTF-8 text" in messages[0] and "lacks run_id" in messages[1] and "not JSON" in messages[2]
    assert all(m.endswith("the line stays in the file as it is, unused") for m in messages)
    assert [r["eval_length"] for r in writer.rows] == [2]  # length 4 is measured again
    writer.write(row("r1", 4))
    lines = file.read_bytes().split(b"\n")
    assert lines[1:4] == [BINARY[:11], b'{"a": 1}', torn]  # byte for byte, in place: nothing measured is lost
    assert [json.loads(line)["eval_length"] for line in (lines[0], lines[4])] == [2, 4]
    with pytest.warns(UserWarning):
        assert [r["eval_length"] for r in read_rows(file)] == [2, 4]


# ---- 5. a binary multirun.yaml; a config.yaml whose train: is not a mapping -------------------------

def test_a_binary_multirun_yaml_is_skipped_and_named(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    add_status(write_run(sweep, "run", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.1}))
    (sweep / "multirun.yaml").write_bytes(b"hydra:\n" + BINARY)
    where = f"{sweep / 'multirun.yaml'}:2: not UTF-8 text (byte 0xce at column 1)"
    assert sweep_progress(sweep, [{"state": "ok"}]) == \
        f"sweep {sweep}: 1 jobs finished, 0 running; the total is not known (skipped {where})"
    assert report_main([str(sweep), "--progress"]) is None
    lines = capsys.readouterr().out.splitlines()
    assert "1 ok; skipped 1 whole file (multirun.yaml), as the report skips them:" in lines
    assert f"  {where}" in lines and lines[-1].startswith(f"sweep {sweep}: 1 jobs finished")


@pytest.mark.parametrize("config,reason", [
    ("train: 5\neval:\n  lengths: null\n", "train: is 5, not a mapping of settings"),
    ("train:\n  - steps\n", 'train: is ["steps"], not a mapping of settings'),
    ("train:\n  steps: many\n", 'train.steps: is "many", not a whole number'),
])
def test_a_config_yaml_whose_train_is_not_a_mapping_is_skipped_and_named(config, reason, tmp_path, capsys):
    run_dir = write_run(tmp_path, "run", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.1}, steps_done=13)
    add_status(run_dir)
    (run_dir / "config.yaml").write_text(config)
    out = write_report([tmp_path], out=tmp_path / "report")
    assert (f"warning: skipped {run_dir / 'config.yaml'}: {reason} (the run's steps and lengths come from its rows)"
            in capsys.readouterr().err)
    assert "1 whole file (config.yaml)" in (out / "report.md").read_text()
    import pandas as pd

    assert pd.read_csv(out / "results.csv")["steps"].tolist() == [13] * 4


def test_a_run_writes_only_into_an_empty_directory_or_its_own(tmp_path):
    """A directory holding files of no posbench run is refused, naming them, and left as it was; '' (the
    current directory) is refused; the run's own directory resumes (tests/test_fault_injection.py)."""
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "config.yaml").write_text("mine\n")
    result = posbench("debug=smoke", f"hydra.run.dir={tmp_path / 'u'}", check=False)
    assert result.returncode == 1
    assert f"hydra.run.dir={tmp_path / 'u'} holds files that are not a posbench run's (config.yaml)" in result.stderr
    assert sorted(p.name for p in (tmp_path / "u").iterdir()) == ["config.yaml"]
    assert (tmp_path / "u" / "config.yaml").read_text() == "mine\n"
    result = posbench("debug=smoke", "hydra.run.dir=''", check=False)
    assert result.returncode == 1 and "hydra.run.dir='' would write the run into the current directory" in result.stderr


@pytest.mark.parametrize("name,make", [("results.jsonl", os.mkfifo), ("status.json", os.mkdir), ("run.lock", os.mkdir)])
def test_posbench_files_that_are_not_regular_files_are_refused_not_hung_on(name, make, tmp_path):
    """A FIFO named results.jsonl (reading it would block for ever) or a directory named status.json or
    run.lock: the run is refused naming it, and the report skips such a file with its reason."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make(run_dir / name)
    result = posbench("debug=smoke", f"hydra.run.dir={run_dir}", check=False, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{run_dir} holds {name} but not as a regular file" in result.stderr
    if name == "results.jsonl":
        for module in ("posbench.report", "posbench.dashboard"):
            read = posbench(str(run_dir), *(["--dry-run"] if module == "posbench.dashboard" else []), module=module,
                            check=False, timeout=60)
            assert "results.jsonl: unreadable: not a regular file (a FIFO, a socket or a device)" in read.stderr
            assert "Traceback" not in read.stderr


# ---- 6. issue 37: tracebacks in place of messages, messages that blamed the wrong thing ------------------

def refused(result, *named: str) -> None:
    """Exit 1, one message naming what is wrong, and no Python traceback."""
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for text in named:
        assert text in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("overrides,named", [
    (["~train.steps"], ["refused: train.steps is missing from the configuration (a ~train.steps override deletes "
                        "it)", "train.steps=10000 (the default; valid: an integer >= 0)"]),
    (["~eval"], ["'eval.lengths', 'eval.seed', 'eval.chunk', 'eval.memory_limit'] are missing from the "
                 "configuration (a ~eval override deletes the option", "eval=<one of ['default']>"]),
    (["~encoding"], ["refused: encoding is missing from the configuration (a ~encoding override deletes the group)"]),
    (["encoding=schedule", "encoding.kinds=garbage"], ["encoding.kinds='garbage' must be a mapping of kind names"]),
    (["encoding=schedule", "encoding.kinds={a: 5}"], ["encoding.kinds.a=5 must be a mapping with `encoding:` one of"]),
    (["logger=wandb", "logger.tags=[a,1]"], ["logger.tags[1]=1: must be a string of 1 to 64 characters"]),
    (["logger=wandb", f"logger.tags=[{'t' * 65}]"], ["must be a string of 1 to 64 characters (wandb's limit); this "
                                                     "one has 65"]),
    (["encoding=dape", "encoding.base_params=notadict"], ["encoding.base_params='notadict': must be a mapping"]),
    (["encoding=urpe", "encoding.base_params=notadict"], ["encoding.base_params='notadict': must be a mapping"]),
], ids=["no-train.steps", "no-eval", "no-encoding", "schedule-kinds", "schedule-kind", "tags-number", "tags-long",
        "dape-base_params", "urpe-base_params"])
def test_a_bad_or_deleted_setting_is_named_without_a_traceback(overrides, named, tmp_path):
    run_dir = tmp_path / "run"
    refused(posbench("debug=smoke", "train.steps=2", *overrides, f"hydra.run.dir={run_dir}", check=False, timeout=120),
            *named)
    assert not (run_dir / "results.jsonl").exists()


@pytest.mark.parametrize("below", ["", "run"])
def test_a_run_directory_that_is_a_file_is_named(below, tmp_path):
    file = tmp_path / "somefile"
    file.write_text("mine\n")
    run_dir = file / below if below else file
    refused(posbench("debug=smoke", f"hydra.run.dir={run_dir}", check=False, timeout=120),
            f"refused: hydra.run.dir={run_dir}: {file} is a file, not a directory; choose another hydra.run.dir")
    sweep = posbench("-m", "debug=smoke", f"hydra.sweep.dir={run_dir}", check=False, timeout=120)
    refused(sweep, f"hydra.sweep.dir={run_dir}: {file} is a file, not a directory")
    assert file.read_text() == "mine\n"


def test_report_out_at_a_regular_file_is_named(tmp_path, finished_run):
    file = tmp_path / "report.txt"
    file.write_text("mine\n")
    for out in (file, file / "sub"):
        result = posbench(str(finished_run), "--out", str(out), module="posbench.report", check=False, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert f"--out {out}: {file} is a file, not a directory; --out names the directory the report is written " \
               "to" in result.stderr
    assert file.read_text() == "mine\n"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    posbench("debug=smoke", "train.steps=2", f"hydra.run.dir={run_dir}")
    return run_dir


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("override,named", [
    ("train.grad_clip=-1", "refused: train.grad_clip=-1: must be > 0"),
    ("+train.stepz=5", "refused: train.stepz is not a train setting; the settings: ['batch_size', "),
    ("device=cuda", "refused: device=cuda but CUDA is not available here; use device=auto or device=cpu"),
    ("encoding.base_params=notadict", "Could not override 'encoding.base_params'"),  # rope has none: Hydra says so
])
def test_a_bad_setting_on_an_existing_run_is_named_before_the_directory_is_compared(finished_run, override, named):
    """Rerun into a finished run's directory with one bad setting: the setting is named (before, grad_clip and
    stepz were refused as "another configuration" and device=cuda found the run finished); the files stay."""
    if override == "device=cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    before = snapshot(finished_run)
    result = posbench("debug=smoke", "train.steps=2", override, f"hydra.run.dir={finished_run}", check=False,
                      timeout=120)
    refused(result, named)
    assert "not of this configuration" not in result.stderr and "nothing to do" not in result.stdout
    assert snapshot(finished_run) == before
