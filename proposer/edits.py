"""Parse a model's reply into template edits and new knobs, and apply them strictly.

Reply format (asked for in the prompt):

    <<<<<<< SEARCH
    exact lines of the current template
    =======
    replacement lines
    >>>>>>> REPLACE

any number of blocks, or one ```jinja fenced whole template; plus optionally one ```yaml
block `knobs: {NAME: {values: [...], default: v, kind: compile}}` for new knobs (or an
existing compile-time knob redeclared with more values).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

_BLOCK = re.compile(r"<<<<<<< SEARCH\n(.*?)\n=======\n(.*?)\n>>>>>>> REPLACE", re.S)
_FENCE = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)```", re.S)
_TEMPLATE_LANGS = ("jinja", "jinja2", "j2", "cuda", "cu", "cpp", "c++", "")


class EditError(ValueError):
    """The reply cannot be applied; the message goes back to the model in the next round."""


@dataclass
class Proposal:
    edits: list[tuple[str, str]] = field(default_factory=list)
    whole: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)


def parse_reply(text: str) -> Proposal:
    text = text.replace("\r\n", "\n")
    prop = Proposal(edits=[(s, r) for s, r in _BLOCK.findall(text)])
    for lang, body in _FENCE.findall(text):
        if lang in ("yaml", "yml"):
            try:
                data = yaml.safe_load(body) or {}
            except yaml.YAMLError as exc:
                raise EditError(f"the yaml block does not parse: {exc}") from None
            if not isinstance(data, dict) or not isinstance(data.get("knobs", {}), dict):
                raise EditError("the yaml block must be a mapping with a 'knobs' mapping")
            prop.knobs = data.get("knobs", {}) or {}
        elif lang.lower() in _TEMPLATE_LANGS and not prop.edits and "__global__" in body:
            if prop.whole is not None:
                raise EditError("the reply holds more than one whole template; send exactly one")
            prop.whole = body
    if not prop.edits and prop.whole is None:
        raise EditError("no SEARCH/REPLACE block and no whole template found in the reply")
    return prop


def apply(template: str, prop: Proposal) -> str:
    if prop.whole is not None:
        return prop.whole
    out = template
    for i, (search, replace) in enumerate(prop.edits, 1):
        count = out.count(search)
        if count == 0:
            first = next((ln for ln in search.splitlines() if ln.strip()), "")
            hint = (" (its first line is in the template: the lines after it differ)" if first and first in out
                    else "")
            raise EditError(f"SEARCH block {i} does not match the template exactly{hint}:\n{search[:300]}")
        if count > 1:
            raise EditError(f"SEARCH block {i} matches {count} places; include more context to make it unique")
        out = out.replace(search, replace, 1)
    return out
