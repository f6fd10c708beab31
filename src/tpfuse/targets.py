"""The GPU a call runs on, as the host sees it, with no Triton: its architecture and vendor
(:class:`Target`), the fp8 format of its outputs (:class:`Fp8Format`: float8_e4m3fn, float8_e4m3fnuz on
gfx942) and its timer (the kernels' wait bounds are in its ticks). ``kernels.vendor`` makes the same
choices inside a kernel, for the architecture it is compiled for.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: The variable that names the architecture the CPU interpreter stands in for.
INTERPRET_ARCH_ENV = "TPFUSE_INTERPRET_ARCH"
DEFAULT_INTERPRET_ARCH = "sm90"
#: The rate at which the interpreter serves AMD's ``s_memrealtime`` (MI300's wall clock).
INTERPRETED_AMD_TIMER_HZ = 100_000_000
NVIDIA_TIMER_HZ = 1_000_000_000  # %globaltimer counts nanoseconds
_ARCH_PATTERN = re.compile(r"^(sm\d+|gfx[0-9a-f]+)$")


@dataclass(frozen=True)
class Fp8Format:
    """An fp8 format the fused op's fp8 outputs take.

    Attributes
    ----------
    dtype : torch.dtype
        ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
    max : float
        Its largest finite value (448 or 240): static fp8 clamps ``y / scale`` to it, dynamic fp8
        divides a row's (or group's) largest magnitude by it.
    exponent_bias : int
        7 (e4m3fn) or 8 (e4m3fnuz): a code of the FNUZ format is worth half the same e4m3fn code.
    """

    dtype: torch.dtype
    max: float
    exponent_bias: int

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def min_dynamic_scale(self) -> float:
        """Smallest dynamic fp8 scale: a row (or group) of zeros quantises to zeros, never to NaN."""
        return 1.0 / (self.max * 512)


E4M3FN = Fp8Format(torch.float8_e4m3fn, 448.0, 7)
E4M3FNUZ = Fp8Format(torch.float8_e4m3fnuz, 240.0, 8)
#: Architectures whose fp8 is FNUZ in hardware (CDNA3); CDNA4 (gfx950) converts the OCP formats.
FNUZ_ARCHES = ("gfx940", "gfx941", "gfx942")


def _check_arch(arch: str, source: str) -> str:
    if not _ARCH_PATTERN.match(arch):
        raise ValueError(f"tpfuse: {source} is {arch!r}; expected an NVIDIA 'sm<NN>' (sm90) or an AMD "
                         "'gfx<id>' (gfx942, gfx950)")
    return arch


def fp8_format_of(arch: str) -> Fp8Format:
    """The fp8 format of the fused op's outputs on ``arch``."""
    return E4M3FNUZ if arch in FNUZ_ARCHES else E4M3FN


@dataclass(frozen=True)
class Target:
    """The GPU architecture kernels are built for: a device's, or the one the CPU interpreter stands in for.

    Attributes
    ----------
    arch : str
        ``sm90`` (NVIDIA, compute capability 9.0), ``gfx942`` (AMD MI300X), ``gfx950`` (MI355X), ...
    interpreted : bool
        True for the CPU interpreter (``TRITON_INTERPRET=1``) running the kernels as ``arch`` would.
    """

    arch: str
    interpreted: bool = False

    @property
    def amd(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def vendor(self) -> str:
        return "amd" if self.amd else "nvidia"

    @property
    def warp_size(self) -> int:
        """Threads of a warp (NVIDIA) or wavefront (AMD's data-centre GPUs)."""
        return 64 if self.amd else 32

    @property
    def max_warps(self) -> int:
        """Warps a program may have: 1024 threads on both vendors."""
        return 1024 // self.warp_size

    @property
    def has_pdl(self) -> bool:
        """Programmatic dependent launch: NVIDIA Hopper and newer only (ROCm has none)."""
        return not self.amd and not self.interpreted and int(self.arch[2:]) >= 90

    @property
    def fp8(self) -> Fp8Format:
        return fp8_format_of(self.arch)


def interpreted_arch() -> str:
    """The architecture the CPU interpreter runs the kernels as: ``$TPFUSE_INTERPRET_ARCH`` or sm90."""
    return _check_arch(os.environ.get(INTERPRET_ARCH_ENV) or DEFAULT_INTERPRET_ARCH, f"${INTERPRET_ARCH_ENV}")


def on_rocm() -> bool:
    """Whether this torch is a ROCm build (its "cuda" devices are AMD GPUs)."""
    return torch.version.hip is not None


def target(device: torch.device | str | None = None) -> Target:
    """The :class:`Target` of ``device`` (a GPU; the CPU: the interpreter's, see :func:`interpreted_arch`)."""
    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return Target(interpreted_arch(), interpreted=True)
    return _gpu_target(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _gpu_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    if on_rocm():
        # "gfx942:sramecc+:xnack-": the architecture, then its features.
        return Target(_check_arch(props.gcnArchName.split(":")[0], f"GPU {index}'s gcnArchName"))
    return Target(f"sm{props.major}{props.minor}")


def fp8_format(device: torch.device | str | None = None) -> Fp8Format:
    """The fp8 format of the fused op's fp8 outputs on ``device`` (the CPU: the interpreted arch's):
    float8_e4m3fnuz on gfx942, float8_e4m3fn elsewhere. The ops, the reference path and the compiler's
    fp8 patterns all ask here."""
    return target(device).fp8


def timer_hz(device: torch.device | str | None = None) -> int:
    """Ticks a second of the timer the kernels read (:func:`now`) on ``device``."""
    device = torch.device(device or "cpu")
    tgt = target(device)
    if not tgt.amd:
        return NVIDIA_TIMER_HZ
    if tgt.interpreted:
        return INTERPRETED_AMD_TIMER_HZ
    return _amd_wall_clock_hz(torch.cuda.current_device() if device.index is None else device.index)


_HIP_WALL_CLOCK_RATE = 10017  # hipDeviceAttributeWallClockRate (hip_runtime_api.h), in kHz
_ASSUMED_AMD_TIMER_HZ = 100_000_000


@functools.cache
def _amd_wall_clock_hz(index: int) -> int:
    """The rate of ``s_memrealtime`` on GPU ``index``, from the HIP runtime torch has loaded."""
    khz = ctypes.c_int(0)
    try:
        hip = ctypes.CDLL("libamdhip64.so")  # already loaded by torch: dlopen finds it by name
        status = hip.hipDeviceGetAttribute(ctypes.byref(khz), _HIP_WALL_CLOCK_RATE, index)
    except OSError as exc:
        status = f"libamdhip64.so: {exc}"
    if status != 0 or khz.value <= 0:
        log.warning("tpfuse: could not read GPU %d's wall clock rate (%s); waits for peers assume %d MHz",
                    index, status, _ASSUMED_AMD_TIMER_HZ // 1_000_000)
        return _ASSUMED_AMD_TIMER_HZ
    return khz.value * 1000


def wait_ticks(device: torch.device | str | None, seconds: float) -> int:
    """A wait bound of ``seconds`` in ticks of the kernels' timer on ``device``."""
    return int(seconds * timer_hz(device))


def cpu_timer_ticks(device: torch.device | str | None = None) -> int:
    """The interpreter's timer now, as the kernels read it on the CPU: a launch's deadline starts here."""
    return time.monotonic_ns() * timer_hz(device) // 1_000_000_000
