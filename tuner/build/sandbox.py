"""The render child for untrusted (LLM-written) templates: a Jinja2 SandboxedEnvironment with no
loader (no filesystem, no imports, no Python internals), in a process bounded in time and memory,
with an environment that holds no secrets. Run as `python -m tuner.build.sandbox`: one JSON job
on stdin, one JSON reply on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RENDER_TIMEOUT_S = 20.0
RENDER_MEMORY_BYTES = 2 << 30
MAX_SOURCE_CHARS = 4 << 20
# The variables a child process may see: enough to find Python and our package, nothing else
# (no OPENAI_API_KEY, no cloud credentials).
CHILD_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")


def child_env() -> dict[str, str]:
    """A minimal environment for a child that handles untrusted input: PATH and locale, and a
    PYTHONPATH that finds this package (an editable checkout or a --target install alike)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {k: os.environ[k] for k in CHILD_ENV_KEEP if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def render_sandboxed(template: str, params: dict[str, Any], timeout_s: float = RENDER_TIMEOUT_S) -> str:
    """Render in a Jinja2 SandboxedEnvironment with no loader (no filesystem, no imports, no
    Python internals), in a child process bounded in time and memory: a template is code, and
    `{% for %}` nests or `'x' * 10**10` would otherwise stall or exhaust the tuner."""
    try:
        with tempfile.TemporaryDirectory(prefix="hgemm-render-") as cwd:
            # An empty working directory: `python -m` puts it first on sys.path, so nothing there
            # can stand in for our modules; and an environment without the caller's secrets.
            proc = subprocess.run([sys.executable, "-m", "tuner.build.sandbox"], input=json.dumps(
                {"template": template, "params": params}), capture_output=True, text=True, timeout=timeout_s,
                env=child_env(), cwd=cwd)
    except subprocess.TimeoutExpired:
        raise ValueError(f"template does not render: rendering ran past {timeout_s:g} s") from None
    try:
        reply = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ValueError(f"template does not render: the renderer died (exit code {proc.returncode}): "
                         f"{proc.stderr.strip()[-300:]}") from None
    if not reply["ok"]:
        raise ValueError(reply["error"])
    return reply["source"]


def _render(template: str, params: dict[str, Any]) -> str:
    import jinja2
    from jinja2.sandbox import SandboxedEnvironment

    # As tuner.build.render renders (same options): the same config gives the same source, one cache entry.
    env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
                               loader=None)
    try:
        source = env.from_string(template).render(**params)
    except jinja2.exceptions.SecurityError as exc:
        raise ValueError(f"sandbox violation: {exc}") from None
    except MemoryError:
        raise ValueError(f"template does not render: over the {RENDER_MEMORY_BYTES >> 30} GiB memory limit") from None
    except Exception as exc:  # noqa: BLE001 - syntax errors, undefined names, `{% include %}` without a loader, ...
        raise ValueError(f"template does not render: {type(exc).__name__}: {exc}") from None
    if len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"template does not render: {len(source)} characters of CUDA is not a kernel")
    return source


def main() -> None:
    """The renderer child: one JSON job on stdin, one JSON reply on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY_BYTES, RENDER_MEMORY_BYTES))
    job = json.loads(sys.stdin.read())
    try:
        reply = {"ok": True, "source": _render(job["template"], job["params"])}
    except ValueError as exc:
        reply = {"ok": False, "error": str(exc)}
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    main()
