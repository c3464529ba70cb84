"""MIG geometry as data: each GPU model's GPU-instance profiles and where each may start.

Sources (docs/mig.md cites them in full):

- Profiles, slice counts, instance counts: NVIDIA's MIG user guide (v580), "Supported MIG Profiles",
  tables 6 (A100), 7 (H100) and 8 (H200).
- Allowed starts (memory-slice index, `nvidia-smi mig -lgipp`): the guide's "List GPU Instance Profiles"
  shows an A100's `19: {0..6}:1, 20: {0..6}:1, 15: {0,2,4,6}:2, 14: {0,2,4}:2, 9: {0,4}:4, 5: {0}:4,
  0: {0}:8`; the H100 and H200 (same GH100 chip, same fractions in tables 7 and 8) take the same starts,
  as the design notes (`shared/design/MIG.md`) list.
- Usable memory and SMs are what NVML reports (`nvidia-smi mig -lgip`, GiB with two decimals, times 1024),
  not the names: A100 from NVIDIA's go-nvml mock (`pkg/nvml/mock/shared/gpus/a100.go`), whose A100-40GB
  figures equal a real driver's listing; H100-80GB from a real H100 SXM5 listing (StackHPC's
  ansible-slurm-appliance, `docs/mig.md`), as MIG.md quotes; H200 from a real listing of three profiles;
  None where no listing was found (the 4-memory-slice H200 profiles' memory). Drivers differ by up to
  0.25 GiB; the real path reads the card's own figures (`Geometry.with_reported`).
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_1G = (0, 1, 2, 3, 4, 5, 6)
EVEN = (0, 2, 4, 6)


@dataclass(frozen=True)
class ProfileRow:
    """One profile of one GPU model, as the guide and NVML describe it."""

    name: str  # as nvidia-smi shows it, e.g. "1g.5gb"
    profile_id: int  # NVML's GPU-instance profile id (nvidia-smi's "ID" column), e.g. 19
    nvml_profile: str  # the NVML constant that reads its info, e.g. "NVML_GPU_INSTANCE_PROFILE_1_SLICE"
    compute_slices: int
    memory_slices: int
    memory_mib: int | None  # usable memory as NVML reports it; None where no source gave it
    sms: int | None
    starts: tuple[int, ...]  # allowed placements: the first memory slice it may take
    max_count: int
    media: bool = False  # "+me": holds the media engines; never picked for a compute task


def _rows(
    names: tuple[str, ...], memory_mib: tuple[int | None, ...], sms: tuple[int | None, ...]
) -> tuple[ProfileRow, ...]:
    """The seven profiles every model here has, in one order; only names, memory and SMs differ."""
    shape = (  # id, NVML constant, compute, memory slices, starts, max count, media
        (19, "NVML_GPU_INSTANCE_PROFILE_1_SLICE", 1, 1, ALL_1G, 7, False),
        (20, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1", 1, 1, ALL_1G, 1, True),
        (15, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2", 1, 2, EVEN, 4, False),
        (14, "NVML_GPU_INSTANCE_PROFILE_2_SLICE", 2, 2, (0, 2, 4), 3, False),
        (9, "NVML_GPU_INSTANCE_PROFILE_3_SLICE", 3, 4, (0, 4), 2, False),
        (5, "NVML_GPU_INSTANCE_PROFILE_4_SLICE", 4, 4, (0,), 1, False),
        (0, "NVML_GPU_INSTANCE_PROFILE_7_SLICE", 7, 8, (0,), 1, False),
    )
    return tuple(
        ProfileRow(name, pid, const, compute, mem, mib, sm, starts, count, media)
        for name, mib, sm, (pid, const, compute, mem, starts, count, media) in zip(
            names, memory_mib, sms, shape, strict=True
        )
    )


MODELS: dict[str, tuple[ProfileRow, ...]] = {
    "A100-40GB": _rows(
        ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
        (4864, 4864, 9856, 9856, 19968, 19968, 40192),
        (14, 14, 14, 28, 42, 56, 98),
    ),
    "A100-80GB": _rows(
        ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        (9856, 9856, 19968, 19968, 40192, 40192, 80384),
        (14, 14, 14, 28, 42, 56, 98),
    ),
    "H100-80GB": _rows(
        ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        (9984, 9984, 20096, 20096, 40448, 40448, 81152),
        (16, 16, 26, 32, 60, 64, 132),
    ),
    "H200-141GB": _rows(
        ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
        (16384, 16384, 33280, 33280, None, None, 143360),
        (16, 16, None, 32, 60, None, 132),
    ),
}
"""Memory MiB: A100 rows from go-nvml's mock; H100-80GB 9.75/19.62/39.50/79.25 GiB; H200 16.00 GiB (1g),
32.50 (2g.35gb; 1g.35gb takes the same two memory slices, and every listing shows profiles of equal memory
slices reporting equal memory) and 140.00 (7g). SMs as listed; H200 3g.71gb 60 as its users report."""
