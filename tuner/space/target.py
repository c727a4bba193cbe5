"""The GPU a kernel is built for and judged against: arch, limits and roofline numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tuner.errors import UserError


@dataclass(frozen=True)
class Target:
    name: str            # e.g. "NVIDIA H200"
    arch: str            # nvcc target, e.g. "sm_90a"
    cc: int              # compute capability * 10, e.g. 90
    sm_count: int
    max_smem: int        # dynamic shared memory per block after opt-in, bytes
    max_threads: int
    peak_tflops: float   # dense fp16 tensor-core peak (datasheet); faster means a bug
    bandwidth_gbs: float  # DRAM bandwidth (datasheet)

    def roofline_us(self, flops: int, min_bytes: int) -> float:
        """The floor: the larger of compute time at peak and DRAM time at full bandwidth."""
        return max(flops / (self.peak_tflops * 1e12), min_bytes / (self.bandwidth_gbs * 1e9)) * 1e6

    def to_dict(self) -> dict:
        return asdict(self)


# Datasheet numbers (dense fp16 with fp32 accumulate). Used only for the roofline and the
# "faster than physics" check; every reported speed is measured.
KNOWN = {
    "sm_90a": Target("NVIDIA H200", "sm_90a", 90, 132, 232448, 1024, 989.4, 4800.0),
    "sm_80": Target("NVIDIA A100-SXM4-80GB", "sm_80", 80, 108, 166912, 1024, 312.0, 2039.0),
    "sm_89": Target("NVIDIA L40S", "sm_89", 89, 142, 101376, 1024, 362.0, 864.0),
}


def target_for_arch(arch: str) -> Target:
    if arch not in KNOWN:
        raise UserError(f"unknown arch {arch!r}; known: {', '.join(KNOWN)}")
    return KNOWN[arch]


def arch_for_cc(major: int, minor: int) -> str:
    """nvcc arch for a device: Hopper needs the 'a' target for wgmma/setmaxnreg."""
    cc = major * 10 + minor
    return "sm_90a" if cc == 90 else f"sm_{cc}"


def target_from_device(props: dict, name: str) -> Target:
    """Build a Target from cudaGetDeviceProperties (as cupy returns it)."""
    major, minor = props["major"], props["minor"]
    arch = arch_for_cc(major, minor)
    base = KNOWN.get(arch)
    return Target(
        name=name, arch=arch, cc=major * 10 + minor, sm_count=props["multiProcessorCount"],
        max_smem=props.get("sharedMemPerBlockOptin", 49152), max_threads=props["maxThreadsPerBlock"],
        peak_tflops=base.peak_tflops if base else 1000.0, bandwidth_gbs=base.bandwidth_gbs if base else 5000.0,
    )
