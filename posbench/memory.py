"""Peak memory of one stretch of work (one evaluation length, a benchmark's timed steps).

CUDA: torch.cuda.max_memory_allocated, reset at `start()`. CPU: the process's resident-set
high-water mark (Linux VmHWM), reset to the current RSS through /proc/self/clear_refs after the
freed heap is handed back to the OS (malloc_trim), so each stretch gets its own peak. Where
that reset is refused, getrusage's ru_maxrss, the process's peak since it began: not
comparable between stretches, so its kind says so.
"""
from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from pathlib import Path

# kinds whose numbers are one stretch's own peak; the report compares only these
PER_STRETCH_KINDS = ("rss_hwm", "cuda_max_allocated")


def rss_kb(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, VmSize, VmData) in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def trim_heap() -> None:
    gc.collect()  # after freeze_live_objects(), of what was made since only
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # else freed blocks would hide new allocations
    except (OSError, AttributeError):
        pass


@contextmanager
def live_objects_frozen():
    """Within the block, every object alive at its start (the imported modules, the model, the optimizer) is out of
    the cycle collector's reach, after one last collection: each gc.collect() inside (trim_heap, once per evaluated
    length) scans only what was made since. With the default job's objects a collection took 0.17 s of CPU, and
    none frozen. Objects still go when their last reference does. They are handed back at the end, so that the
    interpreter's shutdown collects them (frozen, triton's nanobind extension reports them as leaked)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


MMAP_THRESHOLD = 128 * 1024  # bytes; glibc's default threshold grows to 32 MiB once large blocks are freed


def return_large_blocks() -> None:
    """Make glibc serve every allocation over MMAP_THRESHOLD by mmap, so a freed block goes back to
    the OS at once. Chunked evaluation frees and allocates blocks of changing sizes; on the heap they
    fragment it, and the resident set climbs to several times what is live (t5 at 16k tokens:
    0.7 GiB over the model instead of 0.17). No-op where glibc's mallopt is missing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory in MiB since the last `start()`, and the level `start()` found (`base`)."""

    def __init__(self, device):
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "rss_hwm"
        self.base = 0.0

    @property
    def resettable(self) -> bool:
        return self.kind in PER_STRETCH_KINDS

    def start(self) -> None:
        import torch  # here: posbench.results reads PER_STRETCH_KINDS without importing torch

        if self.kind == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / 2**20
            return
        trim_heap()
        if self.kind == "rss_hwm":
            try:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
                self.base = rss_kb("VmRSS") / 1024
                return
            except OSError:
                self.kind = "process_peak_rss"
        import resource  # here: posbench.guard reads rss_kb where there is no `resource` (Windows)

        self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def peak(self) -> float:
        import torch

        if self.kind == "cuda_max_allocated":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.kind == "rss_hwm":
            return rss_kb("VmHWM") / 1024
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
