"""Read a compiled kernel's SASS: proof, without a GPU, that it uses the instructions it claims.

cuobjdump/nvdisasm come with the CUDA toolkit or, on machines without one, with the PyPI
packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (the `dev` extra installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from tuner.errors import UserError

# Opcode families we care about (the first word of a SASS instruction, before any '.').
# ACQBULK is griddepcontrol.wait (PDL: wait for the previous kernel's memory), PREEXIT is
# griddepcontrol.launch_dependents; REDG a global reduction without a result (red.add: a split-K
# arrival counter).
WATCH = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS", "LDSM", "LDL", "STL", "ACQBULK", "PREEXIT", "REDG", "FMUL")


def cuobjdump_path() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the namespace package of NVIDIA's PyPI wheels
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cu12", "cuda_cuobjdump"):
            cand = Path(root) / sub / "bin" / "cuobjdump"
            if cand.is_file():
                return str(cand)
    raise UserError("cuobjdump not found: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump "
                    "nvidia-cuda-nvdisasm`")


def _cuobjdump(option: str, binary: str | Path, what: str) -> str:
    """cuobjdump's report on every kernel of a cubin or a shared library ('Function' per kernel)."""
    tool = cuobjdump_path()
    env = dict(os.environ)
    env["PATH"] = f"{Path(tool).parent}{os.pathsep}{env.get('PATH', '')}"  # cuobjdump runs nvdisasm
    proc = subprocess.run([tool, option, str(binary)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0 or "Function" not in proc.stdout:
        raise UserError(f"cuobjdump could not {what} {binary}: {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def dump_sass(binary: str | Path) -> str:
    """The SASS of every kernel in a cubin or a shared library."""
    return _cuobjdump("--dump-sass", binary, "disassemble")


def static_shared_bytes(binary: str | Path) -> dict[str, int]:
    """Each kernel's static shared memory (cuobjdump -res-usage SHARED, which on sm_90 includes the
    1 KB the system reserves). Dynamic shared memory starts after it, so a kernel that declares any
    of its own moves the dynamic buffer off the alignment TMA and wgmma need."""
    report = _cuobjdump("-res-usage", binary, "read the resource usage of")
    found = re.findall(r"Function ([^\s:]+):\s*\n\s*REG:\d+ STACK:\d+ SHARED:(\d+)", report)
    if not found:
        raise UserError(f"cuobjdump -res-usage of {binary}: no SHARED size in {report.strip()[:300]}")
    return {name: int(size) for name, size in found}


def kernels_sass(sass: str) -> dict[str, str]:
    """A dump_sass text cut into its kernels: {mangled name: that kernel's SASS}."""
    parts = re.split(r"\n\s*Function : (\S+)", sass)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def opcode_counts(sass: str) -> Counter:
    """How many instructions of each WATCH opcode the SASS holds (HGMMA.64x256x16.F32 counts as HGMMA)."""
    counts: Counter = Counter()
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)[.\s]", sass):
        if match.group(1) in WATCH:
            counts[match.group(1)] += 1
    return counts
