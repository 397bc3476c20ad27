"""Start the training processes: under torchrun / srun (RANK and WORLD_SIZE set) join that world; otherwise spawn
`nproc` local processes over gloo (the CPU path) or NCCL (one per visible GPU), stopped with the launcher: a
SIGTERM or SIGINT it receives is forwarded to them and waited for, and its death (even by SIGKILL) sends them one."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_pdm._rundir import locked

# Known, harmless noise on a CPU install: megatron without TE / apex, torch's renamed collectives, a GPU-only hint.
_KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "is deprecated. Please use `torch.distributed",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "full scope is deprecated",
    "`past_key_values` is deprecated",
)


def quiet_known_warnings() -> None:
    import warnings

    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{re.escape(message)}.*")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# What a rank raises for bad input (a config, a run directory, a checkpoint: the message names it), which the
# command prints as one line; anything else is a bug, reported with its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
TRACEBACKS = "MEGATRON_PDM_TRACEBACKS"  # =1: every error keeps its traceback (a ValueError may be a bug after all)
_USER_ERROR_EXIT = 3  # a spawned rank's exit code after a user error, whose message it left in the error directory
_GRACE_S = 10.0  # after a rank fails, how long the others have to end on their own before they are terminated
# after the launcher forwarded a stop, how long the ranks have for their clean-up (the engines stopped) before
# SIGKILL: SGLang's shutdown takes seconds; Slurm's own KillWait, from its SIGTERM to its SIGKILL, is 30 s by default
_STOP_GRACE_S = 60.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def sigterm_exits():
    """SIGTERM raises SystemExit(143) in the main thread while inside, so that every `finally` runs: above all
    `Trainer.run`'s `engine.close()`, which stops the rollout engines and the router. They run in sessions of their
    own (launcher.py), so the signal that ends a rank does not reach them, and a rank killed by SIGTERM's default
    action leaves them running with their GPU memory and ports. torch's spawn join sends SIGTERM to the surviving
    ranks once one failed, torchrun does the same, and so does Slurm at the time limit or on scancel. A second SIGTERM
    takes the default action (each of those senders sends one, then SIGKILL after a grace period: a second one is a
    person who wants the rank gone now, clean-up or not). The handler in force before (SIG_DFL for a rank) is
    restored on the way out; one someone else installed (or SIG_IGN) is kept, as is everything off the main thread
    (where no handler can be installed).

    A rank blocked inside a C++ call (a collective waiting for a peer that died) runs Python signal handlers only
    once that call returns (its timeout): Slurm's cgroup and the launcher's later SIGKILL (torch's join after its
    grace period, torchrun's, Slurm's KillWait) remain the backstop, and then the engines outlive the rank."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _ignore(signum, frame):
    pass


def _die_with(launcher: int) -> None:
    """SIGTERM to this rank when the launcher `launcher` dies, however it died (a SIGKILL, which it cannot
    forward): Linux's parent-death signal, in place of torch's SIGINT, which a script's `megatron-pdm train &`
    ignores. Elsewhere nothing. The rank ends at once if the launcher died already (while this rank started)."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != launcher:  # it died before the call took effect
        raise SystemExit(128 + signal.SIGTERM)


def _worker(rank: int, world: int, port: int, job, args, threads: int, errors: str, launcher: int):
    with sigterm_exits():
        # a terminal's Ctrl-C reaches the whole process group: the launcher forwards it as the one SIGTERM
        # (`_stop_ranks`), and a second signal here would cut this rank's clean-up short
        signal.signal(signal.SIGINT, _ignore)
        _die_with(launcher)
        quiet_known_warnings()
        torch.set_num_threads(threads)
        dist.init_process_group(_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            _in_world(job, args)
        except USER_ERRORS as e:  # to the parent as (class, message), not as a traceback per rank
            if os.environ.get(TRACEBACKS) == "1":
                raise
            kind = next(t for t in USER_ERRORS if isinstance(e, t))
            (Path(errors) / f"rank_{rank}.json").write_text(json.dumps([kind.__name__, str(e)]))
            sys.exit(_USER_ERROR_EXIT)
        finally:
            dist.destroy_process_group()


class _Stop(BaseException):
    """A SIGTERM / SIGINT the launcher received (BaseException: no `except Exception` on its way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals():
    """SIGTERM and SIGINT raise _Stop in the main thread while inside; a signal ignored before (SIG_IGN: a
    background job of a script ignores SIGINT) stays ignored, and the handlers before are restored on the way out.
    Off the main thread (no handler can be installed there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame):
        raise _Stop(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop_ranks(processes, signum: int) -> None:
    """The launcher's stop, forwarded: SIGTERM to every live rank (`sigterm_exits`: a clean exit, the engines
    stopped), up to _STOP_GRACE_S for all of them to end, then SIGKILL to the rest; a second SIGTERM / SIGINT
    meanwhile kills them at once."""
    print(f"megatron-pdm: {signal.Signals(signum).name}: stopping the ranks (a second one kills them)",
          file=sys.stderr, flush=True)
    for p in processes:
        p.terminate()  # SIGTERM, to a rank not yet reaped only: never another process that took its pid
    try:
        with _stop_signals():
            deadline = time.monotonic() + _STOP_GRACE_S
            for p in processes:
                p.join(max(0.0, deadline - time.monotonic()))
    except _Stop:
        pass
    for p in processes:
        p.kill()
        p.join()


def _join(context, errors: Path) -> None:
    """Wait for the spawned ranks; a rank that ended on a user error raises that error here, once, with its
    message (whatever the other ranks did after it); any other failure raises torch's exception (the traceback)."""
    try:
        while not context.join(grace_period=_GRACE_S):
            pass
    except mp.ProcessExitedException:
        # the first rank that left a user error, whichever rank torch noticed first (a peer may have died of the
        # closed connection before it)
        reports = sorted(errors.glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1]))
        if not reports:
            raise
        name, message = json.loads(reports[0].read_text())
        raise {t.__name__: t for t in USER_ERRORS}[name](message) from None


def _in_world(job, args):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return job(*args)


def train_job(cfg, run_dir, resume, data=None):
    from .trainer import Trainer

    trainer = Trainer(cfg, Path(run_dir), data)
    # what start-up built (modules, model, optimizer, engine) lives for the whole run: frozen (after a collection, so
    # that no garbage is frozen with it), it leaves the full collections (megatron's gc.collect() at every checkpoint
    # save) that scanned its ~460K objects, 0.23 s each
    gc.collect()
    gc.freeze()
    return trainer.run(resume=resume)


def analyze_job(cfg, out_dir, seeds, rollouts, pre_updates: tuple[int, ...]):
    from .analyze import format_summary, run_analysis

    result = run_analysis(cfg, out_dir, seeds=seeds, rollouts=rollouts, pre_updates=pre_updates)
    if dist.get_rank() == 0:
        print(format_summary(result["summary"]))
    return result


def _ranks_from_slurm() -> None:
    """Under `srun` with one task per rank (the batch script sets MEGATRON_PDM_SLURM_RANKS=1 and MASTER_ADDR /
    MASTER_PORT), torch's RANK / WORLD_SIZE / LOCAL_RANK are Slurm's PROCID / NTASKS / LOCALID."""
    if os.environ.get("MEGATRON_PDM_SLURM_RANKS") != "1" or "RANK" in os.environ:
        return
    for torch_name, slurm_name in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"),
                                   ("LOCAL_RANK", "SLURM_LOCALID")):
        if slurm_name not in os.environ:
            raise RuntimeError(f"MEGATRON_PDM_SLURM_RANKS=1 but {slurm_name} is not set (not inside srun?)")
        os.environ[torch_name] = os.environ[slurm_name]


def local_world(cfg, nproc: int | None = None) -> int | None:
    """The processes `launch` would spawn here (nproc, default TP x PP x CP x EP of cfg), or None under torchrun / srun,
    whose world it joins."""
    if ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or os.environ.get("MEGATRON_PDM_SLURM_RANKS") == "1":
        return None
    return nproc or cfg.parallel.model_parallel_ranks


def launch(job, args: tuple, cfg, *, nproc: int | None = None, lock=None):
    """Run job(*args) on every rank: in the torchrun / srun world if there is one, else in `nproc` spawned
    processes (default TP x PP x CP x EP of cfg). A user error (`USER_ERRORS`) in a spawned rank is raised here as
    the same class with the same message. `lock`: the directory the job writes (a run directory), held
    (`_rundir.locked`) by the launcher, or global rank 0 under torchrun / srun, from before any rank starts until
    every rank ended; FileExistsError when a live process holds it. A SIGTERM / SIGINT to the launcher stops the
    spawned ranks (`_stop_ranks`) and exits 128 + the signal's number."""
    quiet_known_warnings()
    _ranks_from_slurm()
    first = os.environ.get("RANK", "0") == "0"
    with locked(lock) if lock is not None and first else contextlib.nullcontext():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            with sigterm_exits():  # torchrun / srun end the ranks with SIGTERM: the engines are stopped first
                dist.init_process_group(_backend())
                try:
                    return _in_world(job, args)
                finally:
                    dist.destroy_process_group()
        return _spawn(job, args, nproc or cfg.parallel.model_parallel_ranks)


def _spawn(job, args: tuple, nproc: int) -> None:
    threads = max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory(prefix="megatron-pdm-ranks-") as errors:
        context = mp.start_processes(_worker, args=(nproc, _free_port(), job, args, threads, errors, os.getpid()),
                                     nprocs=nproc, start_method="spawn", join=False)
        try:
            with _stop_signals():
                _join(context, Path(errors))
        except _Stop as stop:
            _stop_ranks(context.processes, stop.signum)
            raise SystemExit(128 + stop.signum) from None
