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

MAX_REPLY_CHARS = 256 << 10   # a longer reply is refused before any parsing
MAX_BLOCKS = 256              # SEARCH/REPLACE blocks in one reply
SEARCH, DIVIDER, REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"
_FENCE_OPEN = re.compile(r"[ \t]*```([\w+-]*)[ \t]*")
_TEMPLATE_LANGS = ("jinja", "jinja2", "j2", "cuda", "cu", "cpp", "c++", "")


class EditError(ValueError):
    """The reply cannot be applied; the message goes back to the model in the next round."""


@dataclass
class Proposal:
    edits: list[tuple[str, str]] = field(default_factory=list)
    whole: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)


def parse_reply(text: str) -> Proposal:
    """The reply's blocks, whole template and knobs. Both scans go line by line, once: no
    backtracking regex, so a reply full of unterminated markers costs what its length does."""
    if len(text) > MAX_REPLY_CHARS:
        raise EditError(f"the reply is {len(text)} characters, over the {MAX_REPLY_CHARS} limit; send only the edits")
    lines = text.replace("\r\n", "\n").split("\n")
    prop = Proposal(edits=_blocks(lines))
    for lang, body in _fences(lines):
        if lang in ("yaml", "yml"):
            try:
                data = yaml.safe_load(body) or {}
            except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: a 5000-digit int
                raise EditError(f"the yaml block does not parse: {str(exc)[:300]}") from None
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


def _blocks(lines: list[str]) -> list[tuple[str, str]]:
    """SEARCH/REPLACE blocks, each marker alone on its line. A marker out of place (a second
    SEARCH before the divider, a block left open at the end) is an error naming its line."""
    blocks: list[tuple[str, str]] = []
    state, start, search, replace = "out", 0, [], []
    for n, line in enumerate(lines, 1):
        mark = line.strip()
        if state == "out":
            if mark == SEARCH:
                state, start, search, replace = "search", n, [], []
        elif state == "search":
            if mark == DIVIDER:
                state = "replace"
            elif mark == SEARCH:
                raise EditError(f"line {n}: a SEARCH marker inside the SEARCH block opened on line {start}")
            else:
                search.append(line)
        elif mark == REPLACE:
            blocks.append(("\n".join(search), "\n".join(replace)))
            if len(blocks) > MAX_BLOCKS:
                raise EditError(f"more than {MAX_BLOCKS} SEARCH/REPLACE blocks; propose one trick at a time")
            state = "out"
        elif mark == SEARCH:
            raise EditError(f"line {n}: a SEARCH marker inside the block opened on line {start} (no {REPLACE})")
        else:
            replace.append(line)
    if state != "out":
        raise EditError(f"the SEARCH block opened on line {start} is not closed with {REPLACE}")
    return blocks


def _fences(lines: list[str]) -> list[tuple[str, str]]:
    """(language, body) of each ``` fenced block; an unclosed fence runs to the end of the reply."""
    fences: list[tuple[str, str]] = []
    lang, body = None, []
    for line in lines:
        if lang is None:
            m = _FENCE_OPEN.fullmatch(line)
            if m:
                lang, body = m.group(1), []
        elif line.lstrip().startswith("```"):
            fences.append((lang, "\n".join(body) + "\n"))
            lang = None
        else:
            body.append(line)
    return fences


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
