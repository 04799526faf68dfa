"""Device facts: the one table of the numbers nsa's kernels and heuristics plan with, read from the device.

`facts(platform)` is the `Device` of this process's first device of `platform` ('cuda' or 'tpu'), looked up by
jax's `device_kind` in `TABLE`. Where the platform has no device here (a program exported for CUDA or TPU from a
CPU machine), the environment variable NSA_DEVICE_KIND names the device to plan for (a kind of TABLE, e.g.
NSA_DEVICE_KIND="NVIDIA H200" to export the kernels an H200 runs). Otherwise, or where the kind is not in the
table, it is `CONSERVATIVE[platform]`: the smallest value of every field among the table's devices of that
platform, so that no plan exceeds a real device's memory. A device of a kind the table lacks is said, with a
RuntimeWarning, once per platform and kind; a platform with no device here is not (a program lowered for it is
exported, or traced for its shapes only: the CPU's Pallas branches trace the TPU kernels on any machine). No kernel module holds a device number of its own: a new GPU generation is a row here
(and, where it changes what is fastest, a measurement behind the kernel's `default_config`).

Sources. NVIDIA: the CUDA C++ Programming Guide, "Compute Capabilities" (shared memory per block with opt-in,
registers per SM: 163 KiB on 8.0, 227 KiB on 9.0 and 10.0, 64 K registers), and each product's datasheet (SMs,
L2, memory bandwidth): A100 (108 SMs, 40 MiB L2; 1.56 TB/s on the 40 GB part, 2.04 on the 80 GB SXM, 1.94 on
the 80 GB PCIe), H100 SXM5 (132 SMs, 50 MiB L2, 3.35 TB/s), H100 PCIe (114 SMs, 50 MiB L2, 2.0 TB/s), H100 NVL
(132 SMs, 3.9 TB/s), H200 (132 SMs, 50 MiB L2, 4.8 TB/s; 4.3 measured here: benchmarks/results/decode.json),
B200 (148 SMs, 126 MiB L2, 8 TB/s). TPU: jax's own table (jax/_src/pallas/mosaic/tpu_info.py: VMEM per
TensorCore, lanes, sublanes, memory bandwidth); Mosaic's default scoped VMEM limit is 16 MiB (32 MiB on v6e
and later, raised per kernel with vmem_limit_bytes).
"""

import os
import warnings
from typing import NamedTuple

import jax

KiB, MiB = 1024, 1024 ** 2


class Device(NamedTuple):
    """What a kernel may plan with on one device (per device as jax sees it; bytes, unless said)."""
    kind: str  # jax's device_kind
    platform: str  # 'cuda' or 'tpu'
    cores: int  # streaming multiprocessors (CUDA) or TensorCores (TPU)
    shared_memory: int  # the most shared memory one CUDA block may use (opt-in); 0 on a TPU
    registers: int  # 32-bit registers per SM; 0 on a TPU
    l2: int  # the L2 cache; 0 on a TPU
    vmem: int  # a TPU TensorCore's VMEM; 0 on CUDA
    scoped_vmem: int  # Mosaic TPU's default scoped VMEM limit: what a kernel may hold without raising it
    lanes: int  # a TPU vreg's lanes; on CUDA the threads of a warp
    sublanes: int  # a TPU vreg's sublanes (32-bit rows); on CUDA 0
    bandwidth: float  # memory bandwidth, bytes per second (datasheet)


def _cuda(kind, sms, shared_kib, l2_mib, tb_per_s):
    return Device(kind, "cuda", sms, shared_kib * KiB, 64 * KiB, l2_mib * MiB, 0, 0, 32, 0, tb_per_s * 1e12)


def _tpu(kind, cores, vmem_mib, scoped_mib, tb_per_s):
    return Device(kind, "tpu", cores, 0, 0, 0, vmem_mib * MiB, scoped_mib * MiB, 128, 8, tb_per_s * 1e12)


TABLE = {d.kind: d for d in (
    _cuda("NVIDIA A100-SXM4-40GB", 108, 163, 40, 1.56),
    _cuda("NVIDIA A100-SXM4-80GB", 108, 163, 40, 2.04),
    _cuda("NVIDIA A100-PCIE-40GB", 108, 163, 40, 1.56),
    _cuda("NVIDIA A100 80GB PCIe", 108, 163, 40, 1.94),
    _cuda("NVIDIA H100 80GB HBM3", 132, 227, 50, 3.35),  # H100 SXM5
    _cuda("NVIDIA H100 PCIe", 114, 227, 50, 2.0),
    _cuda("NVIDIA H100 NVL", 132, 227, 50, 3.9),
    _cuda("NVIDIA H200", 132, 227, 50, 4.8),
    _cuda("NVIDIA B200", 148, 227, 126, 8.0),
    _tpu("TPU v4", 2, 16, 16, 1.23),  # megacore: one device of two TensorCores
    _tpu("TPU v5 lite", 1, 128, 16, 0.819),  # v5e
    _tpu("TPU v5", 2, 64, 16, 2.46),  # v5p, megacore
    _tpu("TPU v6 lite", 1, 128, 32, 1.64),  # v6e
    _tpu("TPU7x", 1, 64, 32, 3.7),  # each of its two TensorCores a device
)}

# jax's other spellings of the same devices
ALIASES = {"TPU v5e": "TPU v5 lite", "TPU v5p": "TPU v5", "TPU v6e": "TPU v6 lite"}


def _smallest(platform):
    rows = [d for d in TABLE.values() if d.platform == platform]
    return Device(f"unknown {platform} device", platform, *(min(column) for column in list(zip(*rows))[2:]))


CONSERVATIVE = {platform: _smallest(platform) for platform in ("cuda", "tpu")}

_warned = set()


def _local_kind(platform):
    """jax's device_kind of this process's first device of `platform`, or None where it has none."""
    try:
        devices = jax.devices(platform)
    except RuntimeError:  # no backend for the platform in this jaxlib, or no device
        return None
    return devices[0].device_kind if devices else None


def _named(kind, platform):
    """The TABLE row NSA_DEVICE_KIND names for `platform` (only where this process has no device of it)."""
    device = TABLE.get(ALIASES.get(kind, kind))
    if device is None or device.platform != platform:
        kinds = ", ".join(repr(k) for k, d in TABLE.items() if d.platform == platform)
        raise ValueError(f"NSA_DEVICE_KIND must name a {platform} device of nsa._device.TABLE ({kinds}) to plan "
                         f"{platform} kernels with, got {kind!r}")
    return device


def facts(platform: str = "cuda") -> Device:
    """The `Device` that kernels for `platform` ('cuda' or 'tpu') plan with in this process (module docstring)."""
    if platform not in CONSERVATIVE:
        raise ValueError(f"platform must be one of {sorted(CONSERVATIVE)}, got {platform!r}")
    kind = _local_kind(platform)
    if kind is None and os.environ.get("NSA_DEVICE_KIND"):
        return _named(os.environ["NSA_DEVICE_KIND"], platform)
    known = TABLE.get(ALIASES.get(kind, kind))
    if known is not None:
        return known
    if kind is not None and (platform, kind) not in _warned:
        _warned.add((platform, kind))
        warnings.warn(f"nsa: the {platform} device {kind!r} is not in nsa._device.TABLE: its kernels plan with the "
                      f"smallest values of the table ({CONSERVATIVE[platform]}); a row of the table gives its own",
                      RuntimeWarning, stacklevel=2)
    return CONSERVATIVE[platform]
