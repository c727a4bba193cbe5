"""Render one kernel configuration of a family into a self-contained CUDA source (Jinja2 sandbox)."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from tuner.build.sandbox import render_sandboxed
from tuner.errors import UserError
from tuner.space import Family

ENTRY = "hgemm"
RENDER_MEMO = 512  # rendered sources of our own templates kept (LRU), by template bytes and variables
_RENDERED: OrderedDict[tuple[str, str, str], str] = OrderedDict()


class RenderError(UserError):
    """A template that fails at these knob values (it may render at others): one trial's failure."""


def make_env(templates_dir: Path) -> SandboxedEnvironment:
    # Sandboxed even for our own templates: the proposer writes templates too, and one
    # code path means the LLM's templates get no more power than ours.
    return SandboxedEnvironment(
        loader=jinja2.FileSystemLoader(str(templates_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_vars(family: Family, config: dict[str, Any], arch: str, accumulate: str) -> dict[str, Any]:
    """Everything a template sees: its compile-time knobs, the problem's ACCUM, and who it is for."""
    return dict(family=family.name, entry=ENTRY, arch=arch, ACCUM=accumulate, **family.compile_config(config))


def _knob_list(family: Family, config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in family.compile_config(config).items())


def template_hash(family: Family) -> str:
    return hashlib.sha256((family.templates_dir / family.template).read_bytes()).hexdigest()[:16]


def render(family: Family, config: dict[str, Any], arch: str, templates_dir: Path | None = None,
           accumulate: str = "fp32", probe: dict[str, Any] | None = None) -> str:
    """CUDA source for the compile-time knobs of `config` (run-time knobs are kernel args),
    with `accumulate` (fp32 | fp16) rendered as ACCUM. `probe`: extra variables for our own
    diagnostic builds (cute_sm90's TIMELINE), never part of a tuned kernel."""
    if accumulate not in family.accumulate:
        raise UserError(f"family {family.name} builds {' and '.join(family.accumulate)} accumulation only, "
                        f"not {accumulate}")
    if family.untrusted:
        if family.artifact != "cubin":
            # Structural, where every build starts: an LLM's code is device code only. A library's
            # host half (launch set-up, constructors) runs in our processes, so it comes only from
            # the project's own templates.
            raise UserError(f"family {family.name}: an untrusted (LLM-written) template builds device code only "
                            f"(artifact cubin), never a host+device library")
        if probe:
            raise UserError(f"family {family.name}: probe variables are for our own templates only")
        return _render_isolated(family, config, templates_dir or family.templates_dir, arch, accumulate)
    folder = templates_dir or family.templates_dir
    try:
        variables = template_vars(family, config, arch, accumulate) | (probe or {})
    except Exception as exc:  # noqa: BLE001 - a config missing a knob: this config's failure, as before
        raise RenderError(f"template {family.template} does not render with {config}: "
                          f"{type(exc).__name__}: {exc}") from None
    try:
        # A sweep renders the same catalogue configs at every shape (~30 ms each): the source is a
        # function of the template's bytes and the variables alone (our templates include no other).
        key = (str(folder / family.template), hashlib.sha256((folder / family.template).read_bytes()).hexdigest(),
               json.dumps(variables, sort_keys=True, default=repr))
    except OSError:
        key = None  # get_template below reports the missing file
    if key is not None and key in _RENDERED:
        _RENDERED.move_to_end(key)
        return _RENDERED[key]
    try:
        template = make_env(folder).get_template(family.template)
    except jinja2.TemplateError as exc:  # missing file, syntax error: no config renders
        where = f"{family.template}:{getattr(exc, 'lineno', '?')}"
        raise UserError(f"template {where} does not render: {type(exc).__name__}: {exc}") from None
    try:
        source = template.render(**variables)
    except Exception as exc:  # noqa: BLE001 - Jinja errors, and Python ones raised inside it (`{{ 1 // X }}`, X=0)
        where = f"{family.template}:{getattr(exc, 'lineno', None) or '?'}"
        raise RenderError(f"template {where} does not render with {_knob_list(family, config)}: "
                          f"{type(exc).__name__}: {exc}") from None
    if key is not None:
        _RENDERED[key] = source
        if len(_RENDERED) > RENDER_MEMO:
            _RENDERED.popitem(last=False)
    return source


def _render_isolated(family: Family, config: dict[str, Any], templates_dir: Path, arch: str, accumulate: str) -> str:
    """An LLM-written template: rendered by the sandboxed child (no loader, bounded time and
    memory), which gives the same source as `render` for the same variables."""
    path = templates_dir / family.template
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"template {path} cannot be read: {exc.strerror}") from None
    try:
        return render_sandboxed(text, template_vars(family, config, arch, accumulate))
    except ValueError as exc:
        raise RenderError(f"template {family.template} (untrusted) with {_knob_list(family, config)}: {exc}") from None


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]
