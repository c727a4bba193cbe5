"""The search space: shapes, GPU targets, and the kernel families of space.yaml.

The bottom stage of the pipeline: everything else reads these records; nothing here
imports a later stage.
"""

from tuner.space.expr import Expr
from tuner.space.loader import SHAPE_PRESETS, default_space_path, load_space
from tuner.space.model import ACCUMULATE, RETIRED_KNOBS, Constraint, Family, Knob, Launch, Space
from tuner.space.shapes import Shape, parse_shape
from tuner.space.target import KNOWN, Target, arch_for_cc, target_for_arch, target_from_device

__all__ = [
    "ACCUMULATE", "KNOWN", "RETIRED_KNOBS", "SHAPE_PRESETS", "Constraint", "Expr", "Family", "Knob", "Launch",
    "Shape", "Space", "Target", "arch_for_cc", "default_space_path", "load_space", "parse_shape",
    "target_for_arch", "target_from_device",
]
