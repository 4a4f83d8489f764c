"""A run directory: the lock that keeps it to one process, its files written atomically, its
status record, its checkpoint, and the signals that stop a run cleanly.

status.json says where the run stands at any moment: `running` (with the phase, the last
step or length and the process), `ok`, `diverged`, `failed` (with the error) or `killed`
(a signal stopped it; a SIGKILL cannot be answered, so a `running` record whose process is
gone on this host also reads as killed). Every file is written to a temporary file and
moved into place with os.replace, so a kill or a full disk never leaves a torn file (one
exception: a failure on a disk too full for a temporary file overwrites status.json in place).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

STATUS_FILE = "status.json"
CHECKPOINT_FILE = "checkpoint.pt"
ROW_FILE = "results.jsonl"  # the rows (posbench.results)
LOCK_FILE = "run.lock"
FINAL_STATES = ("ok", "diverged")  # a run in one of these has nothing left to do
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR2")  # SIGUSR2: submitit's preemption and timeout signal
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Writes the whole file or nothing: a temporary file beside it, fsynced, then os.replace."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # the mode a plain open() would give
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def overwrite_in_place(path: Path, text: str) -> None:
    """Rewrites a small file inside the blocks it already has: the last resort when a full disk
    leaves no room for atomic_write's temporary file. Not atomic: only for recording a failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        data = text.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(obj, path: Path) -> None:
    """torch.save through atomic_write: a kill mid-save leaves the previous checkpoint whole."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getvalue())


def load_checkpoint(path: Path, device, setting: str | None = None) -> dict:
    """A checkpoint written by posbench, or a ValueError that names it (as `setting=path` when a
    setting gave it, train.init_from) and says what the file is instead. Any failure of torch.load
    counts: a text file or random bytes raise KeyError or UnpicklingError, a truncated one
    RuntimeError or EOFError, depending on the torch version; the message keeps torch's words."""
    import torch

    name = f"{setting}={path}" if setting else str(path)
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 - every load failure gets the same answer
        raise ValueError(f"{name}: not a posbench checkpoint (torch.load failed: {load_error_text(err)}; "
                         "the file is truncated, corrupted or not a torch checkpoint)") from None
    missing = [key for key in ("model", "config", "steps") if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        raise ValueError(f"{name}: not a posbench checkpoint (it lacks {missing}; a posbench run saves model, "
                         "config and steps)")
    return checkpoint


def load_error_text(err: BaseException, limit: int = 240) -> str:
    """torch.load's error in one line: its type and words, the weights-only unpickler's own reason
    rather than the advice around it (KeyError: 101, UnpicklingError: Unsupported operand 192)."""
    text = str(err)
    if "WeightsUnpickler error:" in text:  # the reason sits between this mark and a blank line
        text = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0]
    text = " ".join(text.split())
    return f"{type(err).__name__}: {text[:limit] + '...' if len(text) > limit else text}"


def read_regular(path: Path) -> bytes:
    """A file's bytes; a FIFO, socket or device is refused as unreadable (reading one would block or never
    end), a directory as IsADirectoryError, a missing file as FileNotFoundError."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "a directory", str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, a socket or a device)", str(path))
    return Path(path).read_bytes()


def foreign_entries(run_dir: Path) -> list[str]:
    """posbench's own files in a run directory that are not regular files (a directory named status.json,
    a FIFO named results.jsonl, ...): reading or replacing them would fail or hang."""
    return [name for name in (LOCK_FILE, STATUS_FILE, ROW_FILE, CHECKPOINT_FILE)
            if (run_dir / name).exists() and not (run_dir / name).is_file()]


def read_status(run_dir: Path) -> dict | None:
    try:
        record = json.loads(read_regular(Path(run_dir) / STATUS_FILE).decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # ValueError: not JSON, not UTF-8
        return {"state": "unreadable", "error": f"{type(err).__name__}: {err}"}
    return record if isinstance(record, dict) else {"state": "unreadable", "error": "not a JSON object"}


def process_alive(status: dict) -> bool | None:
    """Whether the process a `running` status names is alive: None when it ran on another host."""
    if status.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(status["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return None
    return True


def describe(status: dict | None) -> str:
    """One line for the report: the state, and where a run that did not finish stopped."""
    if status is None:
        return "no status record"
    state = status.get("state")
    where = (f"step {status['step']} of {status['steps']}" if status.get("phase") == "train"
             else f"evaluating length {status['length']}" if status.get("length") is not None else status.get("phase"))
    if state == "running":
        alive = process_alive(status)
        if alive is False:
            return f"killed (process {status.get('pid')} gone) at {where}"
        host = "" if alive else f" on {status.get('host')}"
        return f"running{host} at {where} (last update {status.get('updated')})"
    if state == "killed":
        return f"killed by {status.get('signal')} at {where}"
    if state == "failed":
        return f"failed at {where}: {status.get('error')}"
    return str(state)


class Status:
    """The run's status.json, rewritten atomically on every update; `writes=False` keeps the record
    without the file (the ranks > 0 of a data-parallel run: rank 0 writes it)."""

    def __init__(self, run_dir: Path, writes: bool = True, **identity):
        self.path = Path(run_dir) / STATUS_FILE
        self.writes = writes
        self.record = {"state": "running", "phase": "build", **identity, "pid": os.getpid(),
                       "host": socket.gethostname(), "started": now()}

    def update(self, **fields) -> None:
        self.record |= fields | {"updated": now()}
        if self.writes:
            atomic_write(self.path, self.text())

    def fail(self, error: str) -> None:
        """Records `failed` with the error, in place when the disk is too full for a new file."""
        self.record |= {"state": "failed", "error": error[:1000], "updated": now()}
        if not self.writes:
            return
        try:
            atomic_write(self.path, self.text())
        except OSError:
            try:
                overwrite_in_place(self.path, self.text())
            except OSError as err:  # the error being recorded matters more: warn, and let it through
                print(f"warning: could not record the failure in {self.path}: {type(err).__name__}: {err}",
                      file=sys.stderr)

    def text(self) -> str:
        return json.dumps(self.record, indent=1, default=str) + "\n"


class RunBusy(RuntimeError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """<run dir>/run.lock: the one process allowed to write the run directory, recorded as its pid,
    host and start time.

    The process holds an exclusive flock on the file, which the kernel drops when the process
    ends, however it ends: a lock file nobody holds (its process was SIGKILLed) is stale and taken
    over. A held lock refuses the second process, naming the first, before it writes anything.
    Where flock does not exclude (a filesystem without locks), a record naming a live process on
    this host still refuses. Released (the file removed) when the `with` block ends."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None
        self.stale: dict | None = None  # the record of a gone process this lock took over

    def __enter__(self) -> RunLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_lock(fd, wait=True)
                os.close(fd)
                raise RunBusy(self.busy(holder)) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder released (removed) it between our open and flock: open it again
        previous = read_lock(fd)
        if previous and previous.get("pid") != os.getpid() and process_alive(previous):
            os.close(fd)
            raise RunBusy(self.busy(previous, held=False))
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": now()}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.stale = fd, previous
        return self

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # before letting go: a waiting process then opens a new file
        os.close(self.fd)
        self.fd = None

    def busy(self, holder: dict | None, held: bool = True) -> str:
        who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
               if holder else "a process that is starting")
        return (f"{self.path.parent} is in use by {who} (see {self.path}); one process per run directory: "
                "wait for it to end, or stop it (the same command then resumes the run), or choose another "
                "hydra.run.dir" + ("" if held else f". That process does not hold the lock: if it is not a "
                                                   f"posbench run (its pid was reused), remove {self.path}"))


def read_lock(fd: int, wait: bool = False) -> dict | None:
    """The record in a lock file; `wait`: a holder that has just taken it may not have written it yet."""
    for _ in range(20 if wait else 1):
        try:
            record = json.loads(os.pread(fd, 4096, 0))
            if isinstance(record, dict):
                return record
        except ValueError:  # empty or torn
            pass
        if wait:
            time.sleep(0.05)
    return None


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


class StopRequest(BaseException):
    """Raised at a safe point (between training steps or evaluation batches) once a stop signal came.
    Not an Exception, like KeyboardInterrupt: handlers that record a failure let it through."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """While active, SIGTERM/SIGINT/SIGUSR2 only mark a stop (a second one exits at once); the
    runner calls `check()` at safe points, which raises StopRequest. `forward()` then hands the signal to the handler that was
    installed before (submitit's requeue), or exits with 128 + the signal number.

    Inside `interruptible(stop_now)` (an evaluation at one length, whose partial work a stop may drop) a
    signal ends the process at once instead: one batch at a long length can be one torch call of many
    minutes, and Python runs its signal handlers only once that call returns. A watcher thread, woken
    through signal.set_wakeup_fd while the main thread computes, calls stop_now(signum) (the runner
    records the stop and releases the directory), hands the signal on and exits. A data-parallel run
    gives no stop_now: one rank ending alone would fail its peers inside a collective."""

    def __init__(self, stop_now=None):
        self.signum: int | None = None
        self.previous: dict[int, object] = {}
        self.stop_now = stop_now  # stop_now(signum): what a stop inside an interruptible section does first
        self.inside = False  # the main thread is in an interruptible section
        self.section = threading.Lock()  # held by the watcher while it ends the process: the section stays

    def _mark(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now, from the last checkpoint
            raise SystemExit(128 + signum)
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise StopRequest(self.signum)

    @contextmanager
    def active(self):
        if threading.current_thread() is not threading.main_thread():  # handlers need the main thread
            yield self
            return
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                self.previous[signum] = signal.signal(signum, self._mark)
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)  # set_wakeup_fd's requirement
        watcher = threading.Thread(target=self._watch, args=(wake_read,), name="posbench-stop-watcher", daemon=True)
        watcher.start()
        previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        try:
            yield self
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)
            os.close(wake_write)  # the watcher reads the end of the pipe and returns
            watcher.join()
            os.close(wake_read)

    @contextmanager
    def interruptible(self):
        """A section that a stop may cut short: stop_now(signum) records the stop, then the process ends."""
        with self.section:
            self.inside = self.stop_now is not None
        try:
            yield
        finally:
            with self.section:  # blocks for good once the watcher is ending the process
                self.inside = False

    def _watch(self, wake_read: int) -> None:
        stopping = set(self.previous)
        while data := os.read(wake_read, 64):  # a byte per signal the process received
            for signum in data:
                if signum not in stopping:
                    continue
                with self.section:
                    if not self.inside:
                        continue  # the main thread is at safe points: its handler marked the stop
                    try:
                        self.stop_now(signum)
                    except Exception as err:  # noqa: BLE001 - a stop that cannot be recorded still stops
                        print(f"warning: could not record the stop: {type(err).__name__}: {err}", file=sys.stderr)
                    os._exit(self.handed_on(signum))

    def handed_on(self, signum: int) -> int:
        """forward() from the watcher thread: the exit status the previous handler chose, else 128 + signum."""
        try:
            self.forward(signum)
        except SystemExit as request:
            code = request.code
        except Exception as err:  # noqa: BLE001 - the process ends either way; say why the handler failed
            print(f"warning: the previous handler of {signal.Signals(signum).name} failed: "
                  f"{type(err).__name__}: {err}", file=sys.stderr)
            code = 128 + signum
        sys.stdout.flush()
        sys.stderr.flush()
        return code if isinstance(code, int) else 1

    def forward(self, signum: int):
        handler = self.previous.get(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signum, None)  # submitit: checkpoint() the job, requeue it and exit
        raise SystemExit(128 + signum)
