"""scripts/gpu_wheels.sh and `run_all.sh --wheels` on a CPU: the wheels a GPU machine without network lacks resolve
for CPython 3.12 on manylinux x86_64, one version each, within the 64 MiB carried to it with this checkout, and
install there with run_all.sh's own command (run here by a Python 3.12), every requirement met by the set or by what
that machine has."""

import glob
import importlib.metadata
import os
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "linux_x86_64"]
# what the GPU machine has that the set needs (versions where known: torch's CUDA build, its transformers' peers)
DEVICE = {"torch": "2.11.0", "numpy": "2.5.2", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
          "safetensors": "0.8.0", "triton": "3.6.0", "packaging": None, "pyyaml": None, "regex": None, "typer": None,
          "tqdm": None, "sympy": None, "rich": None, "matplotlib": None, "tensorboard": None, "pyarrow": None,
          "psutil": None}
ABSENT = {"wandb": "a binary wheel, imported only for logging.wandb"}
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def _python312() -> str | None:
    """A CPython 3.12 on this machine (pyenv's where no python3.12 is on PATH), or None."""
    for candidate in (os.environ.get("GPU_WHEELS_PYTHON"), *sorted(glob.glob(os.path.expanduser(
            "~/.pyenv/versions/3.12*/bin/python3.12"))), "/usr/bin/python3.12"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.e2e
def test_gpu_wheels_resolve_for_cp312_fit_64_mib_and_install_as_run_all_does(tmp_path):
    py312 = _python312()
    if py312 is None:
        pytest.skip("no CPython 3.12 here to install cp312 wheels with (set GPU_WHEELS_PYTHON)")
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), str(wheels)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    supported = {*cpython_tags((3, 12), platforms=PLATFORMS), *compatible_tags((3, 12), "cp312", PLATFORMS)}
    gathered = {}
    for f in sorted(wheels.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(f.name)
        assert tags & supported, f"{f.name} does not install on CPython 3.12, manylinux x86_64"
        assert name not in gathered, f"two versions of {name}: {gathered.get(name)} and {version}"
        gathered[name] = str(version)
    assert gathered.keys() == {"megatron-core", "megatron-pdm", "transformers", "math-verify", "latex2sympy2-extended",
                               "antlr4-python3-runtime"}
    pins = dict(line.split("==") for line in (ROOT / "constraints-mcore-latest.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert gathered["megatron-core"] == pins["megatron-core"]
    checkout = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                              capture_output=True, check=True).stdout.decode().split("\0")
    size = sum(f.stat().st_size for f in wheels.glob("*.whl")) + sum(
        (ROOT / p).stat().st_size for p in checkout if p and (ROOT / p).is_file())
    assert size <= 64 * 2**20, f"{size / 2**20:.1f} MiB to carry"
    # run_all.sh --wheels installs them (its command, by this Python 3.12), then stops here: no torch for 3.12
    out = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_all.sh"), "--no-gpu", "--wheels", str(wheels),
                          "--site", str(site), "--out", str(tmp_path / "out")],
                         env={**os.environ, "PYTHON": py312}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "cannot import torch" in out.stdout, out.stdout + out.stderr
    installed = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(site)])}
    assert {n: d.version for n, d in installed.items()} == gathered
    for name, dist in installed.items():
        for req in map(Requirement, dist.requires or []):
            if req.marker is not None and not req.marker.evaluate(MARKERS):
                continue
            needed = canonicalize_name(req.name)
            if needed in ABSENT:
                continue
            assert needed in installed or needed in DEVICE, f"{name} needs {req}: neither carried nor on the machine"
            have = installed[needed].version if needed in installed else DEVICE[needed]
            assert have is None or req.specifier.contains(have, prereleases=True), f"{name} needs {req}, has {have}"
