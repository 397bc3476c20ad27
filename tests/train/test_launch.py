"""The launcher's ranks end with it, and one live process at a time writes a run directory (train/launch.py,
_rundir.locked): a SIGTERM to `megatron-pdm train` stops its ranks cleanly, a SIGKILL makes them stop (the
parent-death signal), a second trainer on a live run directory is refused, and the lock a killed one left is
taken over."""

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_pdm._rundir import RunDir, locked
from tests.helpers import ROOT

NO_SUCH_PID = 2**22 + 1  # above Linux's largest pid_max (PID_MAX_LIMIT): never a live process


def test_a_live_lock_is_refused_naming_its_owner(tmp_path):
    """flock is per open file: a second `locked` of the same directory, even in this process, is refused with one
    line naming the host, the pid and the lock file; after the first is released the directory is free again and
    the lock file gone."""
    run = tmp_path / "run"
    with locked(run) as path:
        assert path == RunDir(run).lock and path.read_text() == f"{socket.gethostname()} {os.getpid()}\n"
        with pytest.raises(FileExistsError) as refused, locked(run):
            pass
    assert str(refused.value).startswith(f"{run}: in use by pid {os.getpid()} on host {socket.gethostname()} "
                                         f"(the lock file {path});")
    assert "\n" not in str(refused.value) and not path.exists()
    with locked(run):
        pass


def test_a_stale_lock_is_taken_over(tmp_path, capsys):
    """A lock file its owner left behind (killed: nothing removed it, the kernel released its flock), from this
    host or another (a Slurm job requeued on another node): taken over with a message naming the old owner."""
    for host in (socket.gethostname(), "node-that-failed"):
        RunDir(tmp_path).lock.write_text(f"{host} {NO_SUCH_PID}\n")
        with locked(tmp_path) as path:
            assert path.read_text() == f"{socket.gethostname()} {os.getpid()}\n"
        assert capsys.readouterr().err == (f"{path}: taking over the lock left by pid {NO_SUCH_PID} on host {host} "
                                           "(its process is gone)\n")
        assert not path.exists()


def test_without_file_locks_the_recorded_pid_decides(tmp_path, monkeypatch, capsys):
    """On a file system that keeps no locks (flock fails with ENOLCK: NFS without lockd), the record decides: a
    live pid of this host is refused, a dead one taken over."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunDir(tmp_path).lock
    lock.write_text(f"{socket.gethostname()} {os.getppid()}\n")  # this test's parent: alive
    with pytest.raises(FileExistsError, match=f"in use by pid {os.getppid()} on host"), locked(tmp_path):
        pass
    lock.write_text(f"{socket.gethostname()} {NO_SUCH_PID}\n")
    with locked(tmp_path):
        assert lock.read_text() == f"{socket.gethostname()} {os.getpid()}\n"
    assert f"taking over the lock left by pid {NO_SUCH_PID}" in capsys.readouterr().err and not lock.exists()


# a step of the tiny job in a few seconds, a checkpoint after every step, none pruned (a stop that cut a pruning
# short would leave part of an old checkpoint, which this test does not look at), more steps than it waits for
_TRAIN = [sys.executable, "-m", "megatron_pdm.cli", "train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
          "--nproc", "2", "train.steps=1000", "train.checkpoint_every=1", "train.keep_last=1000",
          "train.eval_every=1000", "train.prompts_per_step=4", "rollout.n=4", "train.eval_prompts=8",
          "train.warm_start_steps=1", "parallel.tensor=1"]


def _consistent(run) -> None:
    """Whole metrics rows and whole checkpoints only (an interrupted write is a .tmp), and no lock left."""
    from megatron_pdm.train.checkpoint import checkpoint_problem

    rows = [json.loads(line) for line in RunDir(run).metrics.read_text().splitlines()]
    assert rows and all("step" in r for r in rows)
    for p in RunDir(run).checkpoints.iterdir():
        assert p.suffix == ".tmp" or checkpoint_problem(p) is None, p
    assert not RunDir(run).lock.exists()


def _ended(procs) -> bool:
    """Every process of `procs` gone, or a zombie (an orphan's, which the container's init may never reap)."""
    import psutil

    def ended(p):
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(ended(p) for p in procs)


def _wait_ended(procs, deadline_s: float = 120.0) -> None:
    """Until every process of `procs` ended: the ranks' clean exit, the resource tracker's on its launcher's exit,
    take seconds; the bound is for a slow machine."""
    end = time.monotonic() + deadline_s
    while not _ended(procs) and time.monotonic() < end:
        time.sleep(0.2)
    assert _ended(procs), [(p, p.cmdline()) for p in procs if not _ended([p])]


def _descendants(proc, seen: list) -> list:
    """`proc`'s processes now, also added to `seen` (for the clean-up)."""
    import psutil

    found = psutil.Process(proc.pid).children(recursive=True)
    seen.extend(found)
    return found


def _start_in_background(argv, stderr) -> subprocess.Popen:
    """`argv` as a script's `argv &` starts it: SIGINT ignored, so that the parent-death signal torch gives its
    ranks (SIGINT) is ignored too, and only the launcher's own forwarding (or `_die_with`) can stop them."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    finally:
        signal.signal(signal.SIGINT, previous)


def _kill_all(procs, seen) -> None:
    """Whatever a test failed at, nothing it started outlives it."""
    import psutil

    for p in [*(psutil.Process(proc.pid) for proc in procs if proc.poll() is None), *seen]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()  # psutil checks it is still that process (not a reused pid)
    for proc in procs:
        proc.wait()


@pytest.mark.e2e
def test_sigterm_to_train_stops_its_ranks_and_frees_the_run(tmp_path, capsys):
    """SIGTERM to `megatron-pdm train &` once it trains: every rank ends (before: they trained on, alone, into the
    run directory), the launcher exits 143, the run directory holds whole rows and checkpoints only and no lock.
    While it runs, a second `train --resume` on its directory is refused in one line naming its host, pid and lock
    file."""
    from megatron_pdm.cli import main
    from megatron_pdm.train.checkpoint import latest_checkpoint

    run, err = tmp_path / "run", tmp_path / "train.err"
    procs, seen = [], []
    try:
        with open(err, "w") as f:  # a file: a full pipe would stall the trainer
            procs.append(_start_in_background([*_TRAIN, "--run-dir", str(run)], f))
        train = procs[0]
        end = time.monotonic() + 600  # a bound for a loaded machine: the first checkpoint comes within seconds
        while latest_checkpoint(RunDir(run).checkpoints) is None:
            assert train.poll() is None and time.monotonic() < end, err.read_text()[-3000:]
            time.sleep(0.2)
        argv = ["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--run-dir", str(run), "--resume"]
        assert main(argv) == 2
        refusal = capsys.readouterr().err
        assert refusal.startswith(f"train: {run}: in use by pid {train.pid} on host {socket.gethostname()} "
                                  f"(the lock file {RunDir(run).lock});") and refusal.count("\n") == 1, refusal
        ranks = _descendants(train, seen)
        assert len([r for r in ranks if r.ppid() == train.pid and "spawn_main" in " ".join(r.cmdline())]) == 2
        train.send_signal(signal.SIGTERM)
        assert train.wait(timeout=300) == 128 + signal.SIGTERM, err.read_text()[-3000:]
        _wait_ended(ranks)
        assert "SIGTERM: stopping the ranks" in err.read_text()  # (a rank's own way out may print a traceback:
        # a peer gone mid-collective, a SIGTERM that landed in an at-fork callback, where Python swallows it)
        _consistent(run)
    finally:
        _kill_all(procs, seen)


@pytest.mark.e2e
def test_a_killed_launcher_takes_its_ranks_along(tmp_path, capsys):
    """SIGKILL to a launcher started with `&`, which cannot forward it: its rank gets SIGTERM all the same (the
    parent-death signal; before: torch's SIGINT, which `&` ignores, and none at all before the rank had imported
    torch) and ends; the lock the launcher left behind is then taken over, with a message naming it."""
    held, ready = tmp_path / "run", tmp_path / "ready"
    job = ["sh", "-c", f"touch {ready}; exec sleep 600"]  # in the rank, once its set-up is done
    code = f"import subprocess; from megatron_pdm.train.launch import launch; launch(subprocess.call, ({job!r},), " \
           f"None, nproc=1, lock={str(held)!r})"
    procs, seen = [], []
    try:
        procs.append(_start_in_background([sys.executable, "-c", code], subprocess.DEVNULL))
        launcher = procs[0]
        end = time.monotonic() + 300  # a bound for a loaded machine: the rank starts within seconds
        while not ready.exists():
            assert launcher.poll() is None and time.monotonic() < end
            time.sleep(0.2)
        _descendants(launcher, seen)  # the resource tracker, the rank, its sleep
        launcher.kill()
        assert launcher.wait(timeout=60) == -signal.SIGKILL
        _wait_ended(seen)
        assert RunDir(held).lock.read_text() == f"{socket.gethostname()} {launcher.pid}\n"  # nobody removed it
        with locked(held):
            pass
        assert capsys.readouterr().err == (f"{RunDir(held).lock}: taking over the lock left by pid {launcher.pid} "
                                           f"on host {socket.gethostname()} (its process is gone)\n")
    finally:
        _kill_all(procs, seen)
