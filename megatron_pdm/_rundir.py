"""A run directory's layout, its one home: every module that reads or writes a run's files (trainer, logger,
checkpoints, engines, submit, sweep, compare) asks `RunDir` where they are.

    <run dir>/
      config.yaml        the resolved config (written when the run goes ahead)
      metrics.jsonl      one JSON row per step (step 0: the evaluation before training)
      plot.png           the logger's plot;  tensorboard/  its event files
      checkpoints/       step_XXXXXXXX/ (published by a rename; train/checkpoint.py)
      weights/           HF exports for engines that load from disk (rollout.sglang.weight_sync disk; .weight_dir)
      logs/              launched engines' and the Slurm job's logs
      submit/            what `megatron-pdm submit` wrote: config.yaml, train.sbatch, engines.sh
      STOP_AND_CHECKPOINT  the job script asks for a checkpoint and a stop (Slurm's pre-timeout signal)
      REQUEUE            the trainer asks the job script to requeue (written after that checkpoint)
      LOCK               "<host> <pid>" of the live process writing the directory (`locked`), gone after it

An `analyze` directory holds config.yaml and:
      study.json         what the study measures (config, rollouts per seed, pre-update counts): a rerun resumes it
      seeds.jsonl        one row per (seed, pre-update count), appended as each seed finishes
      analysis.json      the summary and every row;  analysis.png  the per-seed scatter
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

STOP_FILE = "STOP_AND_CHECKPOINT"
REQUEUE_FILE = "REQUEUE"
LOCK_FILE = "LOCK"


def _entry(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"<run dir>/{name}")


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path):
        object.__setattr__(self, "path", Path(path))

    config = _entry("config.yaml")
    metrics = _entry("metrics.jsonl")
    plot = _entry("plot.png")
    tensorboard = _entry("tensorboard")
    checkpoints = _entry("checkpoints")
    weights = _entry("weights")
    logs = _entry("logs")
    submit = _entry("submit")
    stop_file = _entry(STOP_FILE)
    requeue_file = _entry(REQUEUE_FILE)
    lock = _entry(LOCK_FILE)
    study = _entry("study.json")
    study_seeds = _entry("seeds.jsonl")
    analysis = _entry("analysis.json")
    analysis_plot = _entry("analysis.png")


# -- one writer per directory ----------------------------------------------------------------------------------
# what flock(2) fails with where the file system keeps no locks (NFS without lockd, Lustre without -o flock)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _owner(fd: int) -> tuple[str, int] | None:
    """The (host, pid) a lock file records, None when it is empty (its owner is between open and write)."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split()
    if len(fields) == 2 and fields[1].isascii() and fields[1].isdigit():
        return fields[0], int(fields[1])
    return None


def _alive_here(owner: tuple[str, int]) -> bool:
    """Whether the owner is a live process of this host (signal 0: checks, sends nothing)."""
    if owner[0] != socket.gethostname():
        return False
    try:
        os.kill(owner[1], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _in_use(path: Path, owner: tuple[str, int] | None) -> FileExistsError:
    who = f"pid {owner[1]} on host {owner[0]}" if owner else "a process that is starting"
    return FileExistsError(f"{path.parent}: in use by {who} (the lock file {path}); a second writer would interleave "
                           "its steps and checkpoints with that one's: stop it first, or choose another directory")


def _flocked(fd: int) -> bool:
    """flock `fd` exclusively: True; False where the file system keeps no locks; BlockingIOError when held."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if isinstance(e, BlockingIOError) or e.errno not in _NO_LOCKS:
            raise
        return False
    return True


def _open_locked(path: Path) -> tuple[int, bool]:
    """`path` opened (made if new) and flocked: (fd, True), or (fd, False) where the file system keeps no locks;
    FileExistsError naming the owner when a live process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited: an engine a rank starts never holds it
        try:
            flocked = _flocked(fd)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise _in_use(path, owner) from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd, flocked
        os.close(fd)  # its owner released and removed it between the open and the lock: a new file, again


def _take(path: Path) -> int:
    """The lock file `path` opened, locked and recording this process; a record its dead owner left is taken over
    with a message; FileExistsError naming the live owner."""
    fd, flocked = _open_locked(path)
    owner = _owner(fd)
    if owner is not None and owner != (socket.gethostname(), os.getpid()):
        if not flocked and _alive_here(owner):
            os.close(fd)
            raise _in_use(path, owner)
        why = "its process is gone" if flocked or owner[0] == socket.gethostname() else \
            "this file system keeps no locks, so whether that process still runs cannot be told from here"
        print(f"{path}: taking over the lock left by pid {owner[1]} on host {owner[0]} ({why})", file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def locked(directory):
    """Hold <directory>/LOCK while inside (the directory made if new), so that one live process at a time writes
    a run (or an analyze) directory: a second is refused, a FileExistsError naming the owner's host, pid and the
    lock file, before it writes anything. Released on the way out (the file removed), and by the kernel when the
    holder dies however it died (flock(2)); a lock its dead owner left behind is then taken over, with a message.

    flock rather than a check of the recorded pid: a pid says nothing on another host, where Slurm may requeue
    the job after its node failed, nor after the pid was reused. On NFS (v4, or v3 with lockd) flock is a lock
    the file server holds for every client, released when the client's lease expires (NFSv4: 90 s by default)
    if its host died. Where the file system keeps no locks at all, the record decides instead: a live pid on this
    host is refused, anything else taken over with a message."""
    path = RunDir(directory).lock
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _take(path)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):  # first: whoever opened it meanwhile finds it gone (_take)
            path.unlink()
        os.close(fd)
