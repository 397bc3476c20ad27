"""Engine health: `GET /health` answers 200 (SGLang's body is empty, so only the status counts).

`python -m megatron_pdm.rollout.sglang.health URL... [--timeout S] [--pid P]` waits until every engine is healthy, as
the Slurm batch script does before training starts; it fails early when process P (the engines' srun) exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) is not running
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_healthy(urls, *, deadline_s: float, pid: int | None = None, poll_s: float = 0.5) -> None:
    """Return when every URL is healthy; TimeoutError after deadline_s, RuntimeError when process `pid` exits."""
    end = time.monotonic() + deadline_s
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not is_healthy(u)]
        if not pending:
            return
        if pid is not None and not _running(pid):
            raise RuntimeError(f"the engine processes (pid {pid}) exited before {pending} became healthy")
        if time.monotonic() > end:
            raise TimeoutError(f"engines not healthy after {deadline_s:.0f} s: {pending}")
        time.sleep(poll_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--pid", type=int, help="fail as soon as this process exits")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        wait_healthy(args.urls, deadline_s=args.timeout, pid=args.pid)
    except (TimeoutError, RuntimeError) as e:
        print(f"health: {e}", file=sys.stderr)
        return 1
    print(f"health: {len(args.urls)} engine(s) healthy after {time.monotonic() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
