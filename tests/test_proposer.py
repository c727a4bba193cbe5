"""The proposer loop against a local OpenAI-compatible server on loopback (no GPU: up to nvcc)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proposer.client import ChatClient
from proposer.loop import list_proposals, run_rounds
from tuner.errors import UserError
from tuner.shapes import parse_shape
from tuner.space import load_space

ROOT = Path(__file__).resolve().parent.parent
WMMA = (ROOT / "templates" / "wmma.cu.j2").read_text()
PAD_LINE = next(line for line in WMMA.splitlines() if line.startswith("constexpr int PAD"))

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


def one_run(server: str, tmp_path: Path, mode: str, rounds: int = 1, timeout_s: float = 5, retries: int = 1):
    """Outcomes of a propose run on wmma whose replies are all `mode`."""
    Stub.mode = mode
    client = ChatClient(server, "stub", timeout_s=timeout_s, retries=retries)
    return run_rounds(load_space(ROOT / "space.yaml"), "wmma", [parse_shape("256x256x256")], client,
                      rounds=rounds, candidates=1, out_dir=tmp_path)


@pytest.mark.parametrize("mode, status, needle", [
    ("good", "not_evaluated", "no GPU"),
    ("nomatch", "bad_edit", "does not match"),
    ("norender", "render_error", "NOT_A_KNOB"),
    ("ssti", "sandbox", "sandbox"),
    ("cublas", "static", "not on the allowlist"),
    ("garbage", "bad_reply", "no SEARCH/REPLACE"),
])
def test_each_reply_ends_with_its_outcome(server, tmp_path, mode, status, needle):
    (out,) = one_run(server, tmp_path, mode)
    assert out.status == status and needle in out.reason, out
    rec = list_proposals(tmp_path)[0]
    assert rec["status"] == status
    folder = tmp_path / out.id
    assert (folder / "prompt.txt").read_text() and (folder / "reply.txt").read_text() == REPLIES[mode]
    # The shipped template is never touched by a proposal.
    assert (ROOT / "templates" / "wmma.cu.j2").read_text() == WMMA


@pytest.mark.nvcc
def test_cuda_that_does_not_compile(server, tmp_path):
    (out,) = one_run(server, tmp_path, "nocompile")
    assert out.status == "compile_error" and "error" in out.reason


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
