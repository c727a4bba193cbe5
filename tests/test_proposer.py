"""The proposer loop against a local OpenAI-compatible server on loopback (no GPU: up to nvcc;
a stand-in backend for the accept/reject logic; the real GPU for a wrong kernel, marked `gpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proposer.client import ChatClient
from proposer.evidence import gather
from proposer.loop import list_proposals, run_rounds
from proposer.validate import static_check
from tuner.build.sandbox import render_sandboxed
from tuner.errors import UserError
from tuner.measure import CompareReply, Measurement, variant_key
from tuner.space import load_space, parse_shape, target_for_arch

ROOT = Path(__file__).resolve().parent.parent
WMMA = (ROOT / "templates" / "wmma.cu.j2").read_text()
PAD_LINE = next(line for line in WMMA.splitlines() if line.startswith("constexpr int PAD"))
STORE_LINE = "                h[0] = __floats2half2_rn(f0.x, f0.y);"
assert STORE_LINE in WMMA

GOOD = f"""Add an unroll knob.
<<<<<<< SEARCH
{PAD_LINE}
=======
{PAD_LINE}
constexpr int UNROLL_HINT = {{{{ UNROLL_HINT }}}};  // new knob: not used yet
>>>>>>> REPLACE
```yaml
knobs:
  UNROLL_HINT: {{values: [1, 2], default: 1, kind: compile}}
```"""
REPLIES = {
    "good": GOOD,
    "nomatch": "<<<<<<< SEARCH\nthis line is not in the template\n=======\nx\n>>>>>>> REPLACE",
    "norender": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE} {{{{ NOT_A_KNOB }}}}\n>>>>>>> REPLACE",
    "ssti": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n// {{{{ ''.__class__.__mro__[1].__subclasses__() }}}}"
            "\n>>>>>>> REPLACE",
    "nocompile": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\nthis is not C++;\n>>>>>>> REPLACE",
    "cublas": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n#include <cublas_v2.h>\n>>>>>>> REPLACE",
    # A call into cuBLAS without its header (declared by hand): still a vendor-library call.
    "cublas_call": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\nextern \"C\" int cublasGemmEx(void*);\n"
                   "__device__ void cheat() { cublasGemmEx(nullptr); }\n>>>>>>> REPLACE",
    "include": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n// {{% include 'space.yaml' %}}\n>>>>>>> REPLACE",
    "bomb": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n// {{{{ 'x' * 10**10 }}}}\n>>>>>>> REPLACE",
    # Compiles, and adds 1 to every eighth output: wrong, which only a GPU can tell.
    "wrong": f"<<<<<<< SEARCH\n{STORE_LINE}\n=======\n{STORE_LINE.replace('f0.x,', 'f0.x + 1.0f,')}\n>>>>>>> REPLACE",
    "whole": "Here is the whole template.\n```jinja\n" + WMMA.replace("constexpr int PAD ", "constexpr int PAD  ")
             + "```\n",
    # Redeclaring a knob may add values (each is compiled: PAD=16 breaks a static_assert) ...
    "extend": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n>>>>>>> REPLACE\n"
              "```yaml\nknobs:\n  PAD: {values: [0, 8, 16], default: 8, kind: compile}\n```",
    # ... but never drop any.
    "shrink": f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n>>>>>>> REPLACE\n"
              "```yaml\nknobs:\n  PAD: {values: [8], default: 8, kind: compile}\n```",
    "garbage": "I am sorry, as a language model I cannot do that. 42",
    "timeout": None,
}


class Stub(BaseHTTPRequestHandler):
    mode = "good"
    calls = 0

    def do_POST(self):  # noqa: N802 - http.server API
        length = int(self.headers.get("Content-Length", 0))
        json.loads(self.rfile.read(length))
        Stub.calls += 1
        reply = REPLIES[Stub.mode]
        if reply is None:
            time.sleep(3)  # longer than the client's timeout
            reply = "late"
        body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": reply}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A study of real (replayed) H200 measurements: the evidence a prompt reports, and the
    study that no proposal may disturb."""
    from tuner.measure import ReplayBackend
    from tuner.search import tune

    storage = f"sqlite:///{tmp_path_factory.mktemp('study')}/main.db"
    replay = ReplayBackend(ROOT / "tests" / "data" / "replay_4096x4096x8192.jsonl", "sm_90a")
    tune(load_space(ROOT / "space.yaml"), ["cute_sm80", "wmma"], parse_shape("4096x4096x8192"), replay, trials=8,
         storage=storage, seed=0)
    return storage


def snapshot(storage: str) -> list[tuple]:
    from tuner.search import load_studies

    return [(st.study_name, t.number, t.state.name, t.value, t.user_attrs.get("status"))
            for st in load_studies(storage) for t in st.get_trials()]


def one_run(server: str, tmp_path: Path, mode: str, rounds: int = 1, timeout_s: float = 5, retries: int = 1,
            backend=None, study: str | None = None, versions_dir: Path | None = None):
    """Outcomes of a propose run on wmma whose replies are all `mode`."""
    Stub.mode = mode
    client = ChatClient(server, "stub", timeout_s=timeout_s, retries=retries)
    evidence = gather(study, "wmma", [parse_shape("256x256x256")]) if study else None
    return run_rounds(load_space(ROOT / "space.yaml"), "wmma", [parse_shape("256x256x256")], client,
                      rounds=rounds, candidates=1, out_dir=tmp_path, backend=backend, evidence=evidence,
                      versions_dir=versions_dir or tmp_path / "versions", trials=4)


@pytest.mark.parametrize("mode, status, needle", [
    ("good", "not_evaluated", "no GPU"),
    ("wrong", "not_evaluated", "no GPU"),  # compiles; only a GPU can tell (test_wrong_kernel_fails_verification)
    ("whole", "not_evaluated", "no GPU"),
    ("nomatch", "bad_edit", "does not match"),
    ("shrink", "bad_edit", "keeping all of its values"),
    ("norender", "render_error", "NOT_A_KNOB"),
    ("include", "render_error", "no loader"),
    ("bomb", "render_error", "memory limit"),
    ("ssti", "sandbox", "sandbox"),
    ("cublas", "static", "not on the allowlist"),
    ("cublas_call", "static", "cublasGemmEx"),
    ("garbage", "bad_reply", "no SEARCH/REPLACE"),
])
def test_each_reply_ends_with_its_outcome(server, tmp_path, study, mode, status, needle):
    before = snapshot(study)
    (out,) = one_run(server, tmp_path, mode, study=study)
    assert out.status == status and needle in out.reason, out
    rec = list_proposals(tmp_path)[0]
    assert rec["status"] == status
    folder = tmp_path / out.id
    assert (folder / "prompt.txt").read_text() and (folder / "reply.txt").read_text() == REPLIES[mode]
    assert f"outcome: {status}" in (folder / "log.txt").read_text()
    # The shipped template is never touched by a proposal, nothing is published, the study is intact.
    assert (ROOT / "templates" / "wmma.cu.j2").read_text() == WMMA
    assert not (tmp_path / "versions").exists()
    assert snapshot(study) == before


@pytest.mark.nvcc
@pytest.mark.parametrize("mode, needle", [("nocompile", "error"), ("extend", "PAD=16")])
def test_cuda_that_does_not_compile(server, tmp_path, mode, needle):
    (out,) = one_run(server, tmp_path, mode)
    assert out.status == "compile_error" and needle in out.reason, out


def test_prompt_carries_results_losses_and_errors(server, tmp_path, study):
    sections = "\n".join(gather(study, "wmma", [parse_shape("256x256x256")]))
    assert "TFLOP/s" in sections and "% of roofline" in sections and "cuBLAS" in sections
    assert "Biggest losses to cuBLAS" in sections
    (out,) = one_run(server, tmp_path, "garbage", study=study)
    prompt = (tmp_path / out.id / "prompt.txt").read_text()
    assert sections in prompt
    assert "Constraints:" in prompt and "BM % (16 * WARP_M) == 0" in prompt and "grid = " in prompt
    assert "```jinja\n" + WMMA in prompt
    # A storage that does not exist gives no evidence and is not created.
    missing = tmp_path / "none.db"
    assert gather(f"sqlite:///{missing}", "wmma") == [] and not missing.exists()


def test_sandbox_bounds_time_and_memory():
    with pytest.raises(ValueError, match="ran past"):
        render_sandboxed("{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}", {},
                         timeout_s=2)
    with pytest.raises(ValueError, match="sandbox violation"):
        render_sandboxed("{{ cycler.__init__.__globals__ }}", {})
    assert render_sandboxed("{{ BM * 2 }}\n", {"BM": 64}) == "128\n"


def test_static_checks_name_what_they_found():
    assert "entry point" in (static_check("x") or "")
    src = 'extern "C" __global__ void hgemm(const __half* A, const __half* B, __half* C, int M, int N, int K, int s)'
    assert static_check(src) is None
    for bad, needle in (("cudaStreamCreate(&s);", "streams"), ("cuLaunchKernel(f);", "driver API"),
                        ('printf("%d", 1);', "printf"), ("__host__ void f() {}", "host code"),
                        ("k<<<1, 1>>>();", "launches"), ('asm volatile("trap;");', "trap")):
        assert needle in (static_check(src + "\n" + bad) or ""), bad


class StandIn:
    """A backend for the accept/reject logic without a GPU: every kernel 'verifies' unless `wrong`;
    the child's new knob value UNROLL_HINT=2 runs at `child_speed` x the parent's time."""

    name, simulated, needs_cubin = "stand-in", True, False

    def __init__(self, child_speed: float = 0.9, wrong: bool = False):
        self.target = target_for_arch("sm_90a")
        self.child_speed, self.wrong = child_speed, wrong
        self.compared: list[dict] = []

    def time_us(self, family: str, config: dict) -> float:
        base = 100.0 + config["BM"] / 16 + config["BN"] / 32  # some configs are better than others
        return base * (self.child_speed if config.get("UNROLL_HINT") == 2 else 1.0)

    def evaluate(self, req, timeout_s: float = 60.0) -> Measurement:
        if self.wrong and req.family != "wmma":
            return Measurement("failed", kind="wrong", reason="12 of 65536 outputs differ", simulated=True)
        t = self.time_us(req.family, req.config)
        return Measurement("ok", times_us={variant_key(v): t for v in req.variants}, baselines_us={"cublas": 50.0},
                           simulated=True, gpu="stand-in")

    def compare(self, shape, candidates, timeout_s: float = 300.0, modes=None, torch: bool = True) -> CompareReply:
        self.compared.append(candidates)
        speed = self.child_speed
        return CompareReply(times={"parent": 101.0, "child": 101.0 * speed, "cublas": 50.0},
                            verify={name: {"ok": True} for name in candidates})


@pytest.mark.nvcc
def test_a_winning_child_becomes_a_family_version(server, tmp_path, study):
    before = snapshot(study)
    (out,) = one_run(server, tmp_path, "good", backend=StandIn(0.9), study=study)
    assert out.status == "accepted", out
    assert out.metrics["version"] == "wmma_v2" and out.metrics["shapes"][0]["gain"] > 0.1
    # The child was tuned from the parent's best with the new knob value, then timed head to head.
    assert out.metrics["shapes"][0]["child_config"]["UNROLL_HINT"] == 2
    versions = tmp_path / "versions"
    lineage = json.loads((versions / "wmma_v2.lineage.json").read_text())
    assert lineage["parent"] == "wmma" and lineage["reply"] == REPLIES["good"] and "Knobs (" in lineage["prompt"]
    assert lineage["metrics"]["shapes"][0]["child_us"] < lineage["metrics"]["shapes"][0]["parent_us"]
    # The version is a family of its own: its space file loads and renders with the new knob.
    from tuner.build import render

    fam = load_space(versions / "wmma_v2.yaml").family("wmma_v2")
    assert fam.knobs["UNROLL_HINT"].values == (1, 2)
    assert fam.untrusted, "an LLM wrote it: the tuner must render it in the bounded child"
    assert "UNROLL_HINT = 2;" in render(fam, fam.defaults() | {"UNROLL_HINT": 2}, "sm_90a")
    assert "round 0" in (tmp_path / out.id / "log.txt").read_text()
    assert snapshot(study) == before
    # A second accepted child is the next version.
    (again,) = one_run(server, tmp_path, "good", backend=StandIn(0.9))
    assert again.metrics["version"] == "wmma_v3"


@pytest.mark.nvcc
@pytest.mark.parametrize("speed, wrong, status, needle", [(1.0, False, "rejected", "on 0 of 1 shapes"),
                                                          (0.995, False, "rejected", "on 0 of 1 shapes"),
                                                          (0.9, True, "verify_error", "wrong")])
def test_a_child_that_does_not_win_is_not_kept(server, tmp_path, speed, wrong, status, needle):
    (out,) = one_run(server, tmp_path, "good", backend=StandIn(speed, wrong))
    assert out.status == status and needle in out.reason, out
    assert not (tmp_path / "versions").exists()


@pytest.mark.gpu
def test_wrong_kernel_fails_verification(server, tmp_path, study):
    """On the GPU: a child that compiles but adds 1 to some outputs is caught by the pipeline's
    verification, recorded as such, and nothing else is disturbed."""
    from tuner.measure import GpuBackend

    before = snapshot(study)
    backend = GpuBackend(log_path=tmp_path / "worker.log")
    try:
        (out,) = one_run(server, tmp_path, "wrong", backend=backend, study=study)
        assert out.status == "verify_error" and "wrong" in out.reason, out
        assert list_proposals(tmp_path)[0]["status"] == "verify_error"
        assert "verify 256x256x256 defaults: failed" in (tmp_path / out.id / "log.txt").read_text()
        # The worker still measures a good kernel afterwards.
        (ok,) = one_run(server, tmp_path / "again", "good", backend=backend)
        assert ok.status in ("accepted", "rejected"), ok
    finally:
        backend.close()
    assert snapshot(study) == before
    assert (ROOT / "templates" / "wmma.cu.j2").read_text() == WMMA
    assert not (tmp_path / "versions").exists()


def test_feedback_reaches_the_next_round(server, tmp_path):
    outs = one_run(server, tmp_path, "nomatch", rounds=2)
    assert [o.status for o in outs] == ["bad_edit", "bad_edit"]
    second_prompt = (tmp_path / outs[1].id / "prompt.txt").read_text()
    assert outs[0].id in second_prompt and "does not match" in second_prompt


def test_timeout_is_a_clear_error_and_the_run_stops(server, tmp_path):
    (out,) = one_run(server, tmp_path, "timeout", rounds=3, timeout_s=0.5, retries=2)
    assert out.status == "endpoint_error" and "not reachable after 2 tries" in out.reason


def test_no_endpoint_configured(monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UserError, match="no LLM endpoint configured"):
        ChatClient(None, "m")


def test_cli_propose_then_proposals(server, tmp_path):
    Stub.mode = "garbage"
    cli = [sys.executable, "-m", "tuner.cli"]
    res = subprocess.run([*cli, "propose", "--family", "wmma", "--shape", "256x256x256", "--base-url", server,
                          "--model", "stub", "--backend", "none", "--out", str(tmp_path),
                          "--storage", f"sqlite:///{tmp_path}/none.db"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "bad_reply" in res.stdout and "outcome: bad_reply" in res.stderr  # the table and the round log
    res = subprocess.run([*cli, "proposals", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "bad_reply" in res.stdout and "wmma-" in res.stdout


@pytest.mark.nvcc
def test_the_shipped_cute_sm80_proposal_applies_and_compiles():
    """tests/data/proposals/cute_sm80_epi_fast.md (the H200 demo's reply) against today's template:
    it applies, renders in the sandbox, passes the static checks and compiles, on an odd tile too."""
    from proposer.edits import apply, parse_reply
    from proposer.loop import _new_knobs
    from tuner.build import CompilePool

    fam = load_space(ROOT / "space.yaml").family("cute_sm80")
    prop = parse_reply((ROOT / "tests" / "data" / "proposals" / "cute_sm80_epi_fast.md").read_text())
    template = apply((ROOT / "templates" / "cute_sm80.cu.j2").read_text(), prop)
    knobs, new = _new_knobs(fam, prop.knobs)
    assert new == {"EPI_FAST": [1]} and knobs["EPI_FAST"].default == 0
    pool = CompilePool(2)
    futures = []
    for epilogue in ("direct", "smem"):
        cfg = fam.compile_config(fam.defaults()) | {"EPI_FAST": 1, "EPILOGUE": epilogue, "BM": 96, "BN": 160}
        source = render_sandboxed(template, {"family": "cute_sm80", "entry": "hgemm", "arch": "sm_90a",
                                             "ACCUM": "fp32", **cfg})
        assert static_check(source) is None
        futures.append(pool.submit(source, "sm_90a"))
    try:
        for f in futures:
            res = f.result()
            assert res.ok and res.spill_bytes == 0, res.error
    finally:
        pool.close()


def test_a_child_failing_to_render_at_some_knob_values_fails_that_trial_only(tmp_path):
    """The short tune renders the child at knob combinations the sandbox check never saw: one that
    raises a Python error there (ZeroDivisionError at UNROLL_HINT=2) is a failed trial with the reason,
    and the proposal still ends with an outcome."""
    import dataclasses

    import optuna

    from proposer.judge import _Ctx, _tune_against_parent
    from proposer.loop import _new_knobs
    from tuner.search import load_studies

    space = load_space(ROOT / "space.yaml")
    fam = space.family("wmma")
    template = WMMA + "// {{ 1 // (2 - UNROLL_HINT) }}\n"
    knobs, new = _new_knobs(fam, {"UNROLL_HINT": {"values": [1, 2], "default": 1}})
    (tmp_path / fam.template).write_text(template)
    child = dataclasses.replace(fam, name="wmma_child", knobs=knobs, templates_dir=tmp_path)
    ctx = _Ctx(space, fam, WMMA, "wmma-test-r0c0", 0, tmp_path, [parse_shape("256x256x256")], StandIn(1.0),
               "sm_90a", 4, lambda line: None, tmp_path / "versions", "", "")
    out = _tune_against_parent(ctx, child, new, template, None, {})
    assert out.status == "rejected", out
    failed = [t for st in load_studies(f"sqlite:///{tmp_path}/study.db") for t in st.get_trials()
              if t.user_attrs.get("status") == "render_error"]
    assert failed, "the child's tune never tried UNROLL_HINT=2"
    for t in failed:
        assert t.state == optuna.trial.TrialState.FAIL and t.user_attrs["config"]["UNROLL_HINT"] == 2
        assert "UNROLL_HINT=2" in t.user_attrs["reason"] and "ZeroDivisionError" in t.user_attrs["reason"]
