"""The host a benchmark ran on, recorded in every benchmark's JSON: the same code differs by 1.5x or more between
CPUs (an AVX2-only EPYC against an AVX-512 one, issue 56), so a figure without its CPU cannot be compared.

`host_info(threads)`: the CPU model and a summary of its flags (/proc/cpuinfo), torch's CPU capability (the kernels
ATen dispatches to: `ATEN_CPU_CAPABILITY=avx2` lowers it), the ISA variables set in the environment, the core count
and the intra-op threads the benchmark's processes use.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

# flags that decide the speed of the kernels our figures time: AVX2 / AVX-512 vector width, native bf16 dot products,
# Intel AMX tiles (any amx_* flag)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx")
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpuinfo(text: str) -> dict:
    """The model name, vendor / family / model numbers (a hypervisor may show a generic name: "AMD EPYC") and
    {flag in FLAGS: present} from the text of /proc/cpuinfo (its first processor's lines)."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", platform.processor() or "unknown"),
            "cpu_id": " ".join(f"{label}{fields[k]}" for k, label in (("vendor_id", ""), ("cpu family", "family "),
                                                                     ("model", "model ")) if k in fields),
            "cpu_flags": {f: any(x.startswith("amx_") for x in flags) if f == "amx" else f in flags for f in FLAGS}}


def host_info(threads) -> dict:
    """What the JSON records about the host; `threads`: the intra-op threads per process (an int, or a mapping
    such as {tp: threads per rank})."""
    path = Path("/proc/cpuinfo")
    cpu = cpuinfo(path.read_text()) if path.is_file() else cpuinfo(f"model name: {platform.processor()}")
    return {"node": platform.node(), "machine": platform.machine(), **cpu,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
            "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": sys.version.split()[0]}


def host_line(info: dict) -> str:
    """One printed line naming the host, e.g. 'AMD EPYC (AuthenticAMD family 26 model 2), torch capability AVX512
    (avx2 avx512f avx512_bf16), 2 cpus'."""
    flags = " ".join(f for f, on in info["cpu_flags"].items() if on) or "no listed flags"
    env = "".join(f" {k}={v}" for k, v in info["isa_env"].items())
    return (f"{info['cpu_model']} ({info['cpu_id']}), torch capability {info['torch_cpu_capability']} "
            f"({flags}){env}, {info['cpus']} cpus")
