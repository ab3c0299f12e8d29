"""The slices compile-check answers for: a chip and a count, `v6e-4`, `h100-8`."""

from dataclasses import dataclass

from kernels_pallas.targets import TARGETS, Target

# Chips per slice that jaxrunner plans for (TPU slices of 1, 4 and 8 chips; GPU hosts).
CHIP_COUNTS = (1, 4, 8)
SLICES = tuple(f"{name}-{count}" for name in TARGETS for count in CHIP_COUNTS)


class BadInput(ValueError):
    """What compile-check refuses before compiling (exit status 2): an unknown target, a mesh
    that does not divide the chips, a config the engine cannot serve."""


@dataclass(frozen=True)
class Slice:
    name: str        # "v6e-4"
    target: Target
    chips: int

    @property
    def num_devices(self) -> int:
        return self.chips * self.target.devices_per_chip


def parse_slice(name: str) -> Slice:
    """`v6e-4` -> 4 chips of TPU v6e; raises BadInput naming the slices there are."""
    if name not in SLICES:
        raise BadInput(f"unknown target {name!r}: one of {', '.join(SLICES)}")
    chip, count = name.rsplit("-", 1)
    return Slice(name, TARGETS[chip], int(count))


def mesh_sizes(slice_: Slice, tp_size: int | None, dp_size: int) -> tuple[int, int]:
    """(tp_size, dp_size) on `slice_`: tp_size None takes every device the DP ranks leave.
    Raises BadInput when the mesh does not divide the slice's devices."""
    devices = slice_.num_devices
    if dp_size < 1 or devices % dp_size:
        raise BadInput(f"dp_size {dp_size} does not divide the {devices} devices of "
                       f"{slice_.name}")
    tp = devices // dp_size if tp_size is None else tp_size
    if tp < 1 or devices % (tp * dp_size):
        raise BadInput(f"tp_size x dp_size = {tp} x {dp_size} does not divide the {devices} "
                       f"devices of {slice_.name}")
    return tp, dp_size
