"""What decides this machine's floats, beside the code: one owner for the caches that keep a
computed result (warm starts, base evaluations).

torch's CPU kernels give other last bits on another instruction set (AVX2, AVX-512, AMX) and,
through MKL and oneDNN, on another vendor's processor. Training and greedy decoding turn a last bit
into another token, so a result computed on one machine is not another's: on the same code, the
warm-started arith model answered 30.5% of held-out prompts on the machine that recorded it and
27-28% on others. A cache keyed by this is never read on a machine whose floats differ.
"""

from __future__ import annotations

import os
from functools import cache

# the environment's caps on what MKL and oneDNN dispatch to (ATEN_CPU_CAPABILITY is torch's own,
# and torch reports its effect)
_CAPS = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


@cache
def float_kernels() -> str:
    """This machine's float identity: the processor, torch's CPU kernel level and MKL's and
    oneDNN's caps, e.g. 'GenuineIntel Intel(R) Xeon(R) Processor / AVX512'."""
    import torch

    caps = [f"{name}={os.environ[name]}" for name in _CAPS if os.environ.get(name)]
    return " / ".join([_processor(), torch.backends.cpu.get_cpu_capability(), *caps])


def _processor() -> str:
    """Vendor and model name (/proc/cpuinfo); the platform's name where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    return f"{fields.get('vendor_id', '')} {fields.get('model name', '')}".strip()
