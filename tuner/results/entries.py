"""An export entry -> what it takes to run it on a GPU: the source, the binary kind, the
launch and the run-time knobs. Shared by the runtime loader and `hgemm-tune bench`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.build import render, template_hash
from tuner.measure import LaunchSpec, launch_spec
from tuner.space import Space, parse_shape


@dataclass
class EntryBuild:
    """What one export entry needs to run on a target: the CUDA source to compile, the kind of
    binary, how the GPU worker launches it, and the run-time knobs it passes."""

    family: str
    template: str
    config: dict[str, Any]      # every knob, compile-time and run-time
    variant: dict[str, Any]     # the run-time knobs (kernel arguments)
    source: str
    artifact: str               # cubin | library
    launch: LaunchSpec          # how the worker launches it for the entry's shape on the target
    template_changed: bool      # the template differs from the one the entry was tuned with


def tuned_with_other_template(fam, entry: dict[str, Any]) -> bool:
    """The entry records the hash of the template it was tuned with, and today's differs."""
    return bool(entry.get("template_hash")) and template_hash(fam) != entry["template_hash"]


def entry_build(space: Space, entry: dict[str, Any], target) -> EntryBuild:
    """An export entry (tuner.results.export.entry) -> source, launch and variant for `target`.

    Shared by the loader (`load(...)`) and `hgemm-tune bench`. Raises UserError when the
    family or a knob is not in the space any more."""
    fam = space.family(entry["family"])
    config = fam.complete_stored(entry["knobs"])  # older exports carry ACCUM: it is `accumulate` now
    shape = parse_shape(entry["shape"])
    changed = tuned_with_other_template(fam, entry)
    return EntryBuild(family=fam.name, template=fam.template, config=config,
                      variant=fam.runtime_config(config),
                      source=render(fam, config, target.arch, accumulate=entry.get("accumulate", "fp32")),
                      artifact=fam.artifact,
                      launch=launch_spec(fam, config, shape, target), template_changed=changed)
