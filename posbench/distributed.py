"""Data parallelism: `torchrun --nproc_per_node=K -m posbench ...` (or a submitit job of K tasks)
trains one run with K processes, DistributedDataParallel over gloo on CPU, NCCL on CUDA.

train.batch_size stays the global batch. Every rank draws the same batches with the same
generators, as one process would, and keeps its own rows of each (`shard`); the loss a rank
backpropagates is its share of the global batch's mean (`global_mean`), so DDP's average of the
ranks' gradients is the one-process gradient. Evaluation shards every batch the same way and
sums the metric sums over ranks. Rank 0 alone writes the run directory (posbench.runner); a stop
signal that reaches any rank stops every rank at the same step (`StopVote`). A decision one
rank makes (rank 0's claim on the run directory, a refused setting) reaches every rank before
anything waits on a collective (`from_main`, `agreed`).

A process that torchrun did not start is world size 1: no process group, and every function
here leaves the run exactly as it was.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import sys
from inspect import signature

import torch
import torch.distributed as dist

from posbench import draws
from posbench.rundir import StopRequest, StopSignals


def environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; a submitit job of several tasks
    (hydra/launcher=slurm hydra.launcher.tasks_per_node=K) exports them first. (0, 1, 0) otherwise."""
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        if submitit.JobEnvironment().num_tasks > 1:  # the K tasks run the same config: one data-parallel run
            # every task keeps every GPU of its node; each takes cuda:LOCAL_RANK (local_device)
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def start(device_setting: str) -> None:
    """Joins the process group when several processes run this run (once per process): gloo, and
    NCCL beside it for CUDA tensors when the run uses CUDA; CPU tensors (the stop flag, objects)
    always go through gloo, so they never wait on the GPU."""
    rank, size, local_rank = environment()
    if size == 1 or dist.is_initialized():
        return
    cuda = str(device_setting) != "cpu" and torch.cuda.is_available()
    if cuda:
        local_size, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", size)), torch.cuda.device_count()
        if local_size > gpus:  # NCCL refuses two processes on one GPU, and only after minutes of waiting
            raise ValueError(f"torchrun started {local_size} processes on this machine, which has {gpus} GPU(s): "
                             f"one process per GPU; use --nproc_per_node={gpus}, or device=cpu for gloo on the CPU")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=size)
    atexit.register(dist.destroy_process_group)


def leave(code) -> None:
    """Ends a data-parallel process with `code` (SystemExit's: None, a number or a message): Python's
    exit handlers first (the process group's teardown, the logger's), then os._exit. In one process:
    returns. DistributedDataParallel keeps its process group alive past destroy_process_group (torch
    2.13: gloo's worker and tcp threads still run), and the C++ teardown of a normal exit, racing those
    threads, aborts the process now and then ("terminate called without an active exception": 3 in
    94 two-process runs of `debug=smoke` beside other load), a failed command for a run that
    finished; os._exit skips that teardown."""
    if not dist.is_initialized():
        return
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first; os._exit runs none
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0, the one process that writes the run directory (the only one without torchrun)."""
    return rank() == 0


def local_device(device: torch.device) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK for device=cuda or auto (one GPU per process)."""
    if device.type != "cuda" or size() == 1:
        return device
    if device.index is not None:
        raise ValueError(f"device={device} names one GPU for {size()} processes; use device=cuda or device=auto: "
                         "each process then takes cuda:LOCAL_RANK")
    return torch.device("cuda", torch.cuda.current_device())


def check_batch_size(batch_size: int) -> None:
    if int(batch_size) % size():
        raise ValueError(f"train.batch_size={batch_size} is the global batch and must be divisible by the world "
                         f"size {size()} (torchrun's --nproc_per_node x nodes), so that every rank trains on as many "
                         f"rows; use a multiple of {size()}")


def broadcast(value):
    """Rank 0's value (any picklable object) on every rank."""
    if size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather(value) -> list:
    """Every rank's value, in rank order, on every rank."""
    if size() == 1:
        return [value]
    values = [None] * size()
    dist.all_gather_object(values, value)
    return values


def transportable(err: Exception) -> Exception:
    """The error itself where it survives pickling (an error whose constructor takes more than its
    message does not), else its text in a RuntimeError."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(err).__name__}: {err}")


def from_main(decide):
    """`decide()` on rank 0 alone; its result, or the error it raised, on every rank."""
    if size() == 1:
        return decide()
    result, error = None, None
    if is_main():
        try:
            result = decide()
        except Exception as err:  # noqa: BLE001 - handed to every rank, raised there
            error = err
    result, shared = broadcast((result, None if error is None else transportable(error)))
    if error is not None or shared is not None:
        raise error or shared
    return result


def agreed(step):
    """`step()` on every rank; where it raises on any rank, every rank raises (its own error, or the
    lowest failing rank's), so no rank goes on to wait for the others in a collective."""
    if size() == 1:
        return step()
    result, error = None, None
    try:
        result = step()
    except Exception as err:  # noqa: BLE001 - every rank learns of it before raising
        error = err
    errors = [e for e in gather(None if error is None else transportable(error)) if e is not None]
    if errors:
        raise error or errors[0]
    return result


def smallest(values: dict) -> dict:
    """Each key's smallest value over the ranks (the evaluation batch each length gets: it must
    be one number on every rank, and a rank's free memory may differ)."""
    return {key: min(part[key] for part in gather(values)) for key in values}


def any_signal(signum: int | None) -> int | None:
    """The stop signal any rank received (the largest), on every rank: the run's last collective, so
    every rank leaves together, after rank 0 has released the directory (torchrun stops the other
    ranks at a first non-zero exit)."""
    if size() == 1:
        return signum
    flag = torch.tensor([signum or 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) or None


class StopVote:
    """stop.check() agreed by every rank, at every call, without waiting for the agreement: each call
    reads the all_reduce of the ranks' stop flags that the call before started (long arrived by
    then) and starts the next. A signal that reaches any rank thus stops every rank at the same
    call, one call later than it stops one process. In one process: stop.check()."""

    def __init__(self, stop: StopSignals | None):
        self.stop = stop
        self.pending = None  # (work, flag): the all_reduce in flight

    def check(self) -> None:
        if self.stop is None:
            return
        if size() == 1:
            self.stop.check()
            return
        signum = self.finish()
        if signum:
            self.stop.signum = self.stop.signum or signum  # a rank the signal missed hands it on too
            raise StopRequest(self.stop.signum)
        flag = torch.tensor([self.stop.signum or 0])
        self.pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag

    def finish(self) -> int:
        """Waits for the all_reduce in flight -> the largest signal number it carried (0: none). A loop
        that ends calls it to leave nothing in flight; a signal it carries is seen at the next vote."""
        if self.pending is None:
            return 0
        work, flag = self.pending
        work.wait()
        self.pending = None
        return int(flag)


def shard(batch):
    """This rank's rows of a batch every rank drew alike: its tensors split along the batch dimension
    (torch.tensor_split: the first ranks take one row more where the rows do not divide; a rank may
    get none, as in segment recurrence's one-row segments, all rank 0's)."""
    if size() == 1:
        return batch
    return draws.split_rows(batch, lambda tensor: tensor.tensor_split(size()))[rank()]


def global_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The loss a rank backpropagates for the global batch's total / count: its own total over the
    global count, times the world size, which DDP's gradient average divides away again."""
    if size() == 1:
        return total / count
    count = count.clone()
    dist.all_reduce(count)
    return total * size() / count


def all_sum(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch's metric sums over every rank's rows (one all_reduce), each in its own dtype and device."""
    if size() == 1:
        return sums
    device = next(iter(sums.values())).device
    packed = torch.stack([value.to(device, torch.float64) for value in sums.values()])  # [keys]
    dist.all_reduce(packed)
    return {key: total.to(value.device, value.dtype) for (key, value), total in zip(sums.items(), packed)}


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model under DistributedDataParallel (the model itself in one process). Buffers are not
    broadcast at each forward: every rank computes the same ones. static_graph: the parameters a
    forward leaves unused (complex_order replaces the token table) are found in the first step and
    keep no gradient, as in one process; the graph must then be the same every step, which it is."""
    if size() == 1:
        return model
    ddp = torch.nn.parallel.DistributedDataParallel
    no_buffer_sync = "forward_sync_buffers" if "forward_sync_buffers" in signature(ddp).parameters else \
        "broadcast_buffers"  # torch 2.13 renamed it
    return ddp(model, device_ids=[device] if device.type == "cuda" else None, static_graph=True,
               **{no_buffer_sync: False})


def seed_rank_stream(seed: int, step: int) -> None:
    """Ranks > 0 draw dropout from streams of their own (rank 0 keeps the one-process stream), seeded
    anew each step from (seed, rank, step), so a resumed run draws what an uninterrupted one would."""
    if rank() == 0:
        return
    digest = hashlib.sha256(f"{seed}/{rank()}/{step}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little"))
