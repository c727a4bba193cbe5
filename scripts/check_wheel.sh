#!/usr/bin/env bash
# An installed hgemm-tune (wheel, not the source tree) finds its space and templates from any
# directory: render a kernel, load the packaged space, construct the loader on an export.
#   bash scripts/check_wheel.sh VENV/bin        (run from a directory outside the checkout)
set -euo pipefail
BIN=$1
[[ ! -e space.yaml && ! -e templates ]] || { echo "check_wheel.sh: run it outside the checkout"; exit 1; }
"$BIN/hgemm-tune" render --family wmma --shape 256x256x256 | grep -q 'extern "C"'
"$BIN/python" - <<'PY'
import json, pathlib, tempfile
import tuner
from tuner.space import default_space_path, load_space
assert "site-packages" in tuner.__file__, tuner.__file__
space = load_space()
assert {"wmma", "cute_sm80", "cute_sm90"} <= set(space.families), space.families
entry = {"gpu": "NVIDIA H100 80GB HBM3", "arch": "sm_90a", "shape": "256x256x256", "M": 256, "N": 256, "K": 256,
         "layout": "TN", "accumulate": "fp32", "family": "wmma", "template_hash": None,
         "knobs": {"BM": 64, "BN": 64, "BK": 32, "WARP_M": 2, "WARP_N": 2, "STAGES": 2, "PAD": 8, "SWIZZLE_LOG": 1},
         "source_hash": None, "time_us": 10.0, "tflops": 3.4, "roofline_fraction": 0.5,
         "baselines_us": {"cublas": 5.0}, "speedup": {"cublas": 0.5}, "beats_vendor": False, "pick": "cublas",
         "verification": {}, "simulated": False, "study": "s", "trial": 0}
path = pathlib.Path(tempfile.mkdtemp()) / "best.json"
path.write_text(json.dumps({"schema_version": 1, "tool": "hgemm-tune", "tool_version": tuner.__version__,
                            "created": "2026-12-07T00:00:00+00:00", "simulated": False, "entries": [entry]}))
gemm = tuner.load(path)
assert len(gemm.entries) == 1
print(f"wheel ok: {tuner.__file__}; space {default_space_path()}; {len(space.families)} families")
PY
