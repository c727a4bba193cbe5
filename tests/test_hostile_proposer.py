"""The proposer against a hostile model and a hostile endpoint (loopback stub servers only):
include smuggling that would carry a file's text back to the model through nvcc's errors,
replies built to make the parser crawl, endpoint bodies that are no chat completion, a server
that trickles its answer, and terminal escapes. Each attack must end as a recorded outcome (or
a one-line error), never a traceback, and a planted secret never reaches a prompt or a record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proposer.client import ChatClient, parse_completion
from proposer.edits import MAX_REPLY_CHARS, EditError, parse_reply
from proposer.loop import _CheckedPool, list_proposals, run_rounds
from proposer.validate import INCLUDE_REJECTED, candidate_errors, dependency_check, static_check, terminal_safe
from tuner.space import load_space, parse_shape

ROOT = Path(__file__).resolve().parent.parent
WMMA = (ROOT / "templates" / "wmma.cu.j2").read_text()
PAD_LINE = next(line for line in WMMA.splitlines() if line.startswith("constexpr int PAD"))
MARKER = "HGEMM_SECRET_5f1e0c"
ENTRY = ('extern "C" __global__ void hgemm(const __half* A, const __half* B, __half* C, int M, int N, int K, '
         "int swizzle_log) {}\n")
ESCAPES = ("\x1b", "\x07", "\x9b", "\u202e")


def completion(content) -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": content}}]}).encode()


def after_pad(lines: str) -> str:
    """A reply adding `lines` after the wmma template's PAD line."""
    return f"<<<<<<< SEARCH\n{PAD_LINE}\n=======\n{PAD_LINE}\n{lines}\n>>>>>>> REPLACE\n"


class Hostile(BaseHTTPRequestHandler):
    """Answers every POST with `body` (status, content type), or trickles `trickle` a byte a second."""

    protocol_version = "HTTP/1.1"
    body: bytes = b""
    status = 200
    ctype = "application/json"
    length: int | None = None     # a Content-Length that lies
    trickle: bytes | None = None  # raw bytes, status line included, one per second ...
    burst = 0                     # ... after the first `burst` of them at once
    seen: list[str] = []          # every request body the stub received (what the proposer sent)
    stop = threading.Event()

    def do_POST(self):  # noqa: N802 - http.server API
        Hostile.seen.append(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode("utf-8", "replace"))
        try:
            if Hostile.trickle is not None:
                self.wfile.write(Hostile.trickle[:Hostile.burst])
                self.wfile.flush()
                for b in Hostile.trickle[Hostile.burst:]:
                    if Hostile.stop.is_set():
                        return
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(1.0)
                return
            self.send_response(Hostile.status)
            self.send_header("Content-Type", Hostile.ctype)
            self.send_header("Content-Length", str(Hostile.length if Hostile.length is not None else len(Hostile.body)))
            self.end_headers()
            self.wfile.write(Hostile.body)
            if Hostile.length is not None:
                self.close_connection = True
        except OSError:  # the client hung up (the deadline): that is the point
            pass

    def log_message(self, *args):
        pass


def serve(body: bytes = b"", status: int = 200, ctype: str = "application/json", length: int | None = None,
          trickle: bytes | None = None, burst: int = 0) -> None:
    Hostile.body, Hostile.status, Hostile.ctype, Hostile.length = body, status, ctype, length
    Hostile.trickle, Hostile.burst = trickle, burst


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    Hostile.stop.set()
    srv.shutdown()


@pytest.fixture(autouse=True)
def fresh_stub():
    Hostile.seen = []
    serve(completion("I cannot help with that."))
    yield


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    """A file outside every allowed header root, its text unique: it must never be seen again.
    Its one line holds `error`: nvcc's old filter (lines with 'error') would have kept it."""
    path = tmp_path_factory.mktemp("private") / "secret.h"
    path.write_text(f"{MARKER} error_token;\n")
    return path


def run(server: str, out: Path, rounds: int = 1, timeout_s: float = 5.0, retries: int = 1, log=None):
    client = ChatClient(server, "stub", timeout_s=timeout_s, retries=retries)
    return run_rounds(load_space(ROOT / "space.yaml"), "wmma", [parse_shape("256x256x256")], client, rounds=rounds,
                      candidates=1, out_dir=out, versions_dir=out / "versions", trials=4, log=log)


def records(out: Path) -> str:
    """Everything the run wrote (prompts, replies, templates, logs, outcomes) and sent to the stub."""
    files = "\n".join(p.read_text(errors="replace") for p in sorted(out.rglob("*")) if p.is_file())
    return files + "\n".join(Hostile.seen)


# --- 1. file contents through the compiler -----------------------------------------------------

def smuggling_forms(secret: Path) -> dict[str, str]:
    from tuner.build import cutlass_include

    rel = os.path.relpath(secret, cutlass_include() / "cute")
    return {
        "traversal": f"#include <cute/{rel}>",
        "absolute": f'#include "{secret}"',
        "macro": f'#define HDR "{secret}"\n#include HDR',
        "stringified": f"#define STR(x) #x\n#define XSTR(x) STR(x)\n#include XSTR({secret})",
        "comment_spliced": f'#/**/include "{secret}"',
        "comment_spliced_name": f'# /* x */ include /* y */ "{secret}"',
        "line_spliced": f'#inc\\\nlude "{secret}"',
        "import": f'#import "{secret}"',
        "include_next": f'#include_next "{secret}"',
        "digraph": f'%:include "{secret}"',
        "device_pass_only": f'#ifdef __CUDA_ARCH__\n#define HDR "{secret}"\n#include HDR\n#endif',
        "host_pass_only": f'#ifndef __CUDA_ARCH__\n#define HDR "{secret}"\n#include HDR\n#endif',
        # #line names the file in diagnostics; gcc then prints that file's line under an #error.
        "line_directive": f'#line 1 "{secret}"\n#error boom',
    }


FORMS = list(smuggling_forms(Path("/x")))


@pytest.mark.nvcc
@pytest.mark.parametrize("form", FORMS)
def test_include_smuggling_never_reaches_the_model(server, tmp_path, secret, form):
    """Each form, as a reply: refused before nvcc compiles it; over two rounds, the secret's text
    is in no prompt sent, no outcome and no record."""
    serve(completion(after_pad(smuggling_forms(secret)[form])))
    outs = run(server, tmp_path, rounds=2)
    assert [o.status for o in outs] == ["static", "static"], outs
    assert MARKER not in records(tmp_path)
    assert len(Hostile.seen) == 2 and str(secret.parent) not in Hostile.seen[0]


@pytest.mark.nvcc
@pytest.mark.parametrize("form", [f for f in FORMS if f != "line_directive"])
def test_the_preprocessor_check_alone_refuses_each_form(secret, form):
    """Behind the literal filter, the dependency listing refuses every form on its own."""
    source = "#include <cuda_fp16.h>\n" + smuggling_forms(secret)[form] + "\n" + ENTRY
    assert dependency_check(source, "sm_90a") == INCLUDE_REJECTED


@pytest.mark.nvcc
def test_allowed_headers_pass_and_a_missing_file_looks_like_a_forbidden_one(secret):
    ok = "#include <cuda_fp16.h>\n#include <cute/tensor.hpp>\n#include <cstdint>\n#include <mma.h>\n" + ENTRY
    assert static_check(ok) is None and dependency_check(ok, "sm_90a") is None
    missing = f'#define HDR "{secret.parent}/no_such.h"\n#include HDR\n' + ENTRY  # no existence oracle
    assert dependency_check(missing, "sm_90a") == INCLUDE_REJECTED
    why = dependency_check(f'#line 1 "{secret}"\n#error boom\n' + ENTRY, "sm_90a")
    assert why and MARKER not in why and str(secret) not in why


@pytest.mark.nvcc
def test_every_compile_of_a_proposal_is_checked_first(secret):
    """The short tune compiles knob values the proposal's checks never rendered: its pool checks
    each source before nvcc, and the refusal quotes nothing of the file."""
    pool = _CheckedPool(1)
    try:
        res = pool.submit(f'#define HDR "{secret}"\n#include HDR\n' + ENTRY, "sm_90a").result(timeout=60)
    finally:
        pool.close()
    assert not res.ok and res.error.startswith("rejected before nvcc") and MARKER not in res.error


def test_compiler_output_keeps_only_the_candidates_lines(secret):
    log = ("nvcc exit 2: /tmp/hgemm-nvcc-x/kernel.cu(12): error: identifier \"foo\" is undefined\n"
           f"{secret}(1): error: identifier \"{MARKER}\" is undefined\n"
           f"{secret}:1:2: error: #error boom\n    1 | {MARKER} error_token;\n"
           "/usr/include/cute/x.hpp(3): error: in a header\n"
           "/tmp/hgemm-nvcc-x/kernel.cu:7:3: error: \x1b[31mred\x1b[0m\n"
           "/tmp/hgemm-nvcc-x/not_kernel.cu(1): error: another file\n" + "kernel.cu(1): error: " + "y" * 5000)
    out = candidate_errors(log)
    assert out.splitlines() == ["nvcc exit 2: kernel.cu(12): error: identifier \"foo\" is undefined",
                                "kernel.cu:7:3: error: red", "kernel.cu(1): error: " + "y" * 279]
    assert MARKER not in out and "header" not in out and "another" not in out
    assert len(candidate_errors("nvcc exit 2: " + "kernel.cu(1): error: x\n" * 1000)) <= 1500 + 13
    assert candidate_errors("nvcc exit 1: " + f"{secret}(1): error: {MARKER}") == \
        "nvcc exit 1: (no error reported in the candidate's own lines)"


def test_evidence_from_a_study_keeps_only_the_candidates_lines(tmp_path, secret):
    import optuna

    from proposer.evidence import gather

    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=storage, study_name="s")
    study.set_user_attr("families", ["wmma"])
    study.set_user_attr("shape", "256x256x256")
    trial = study.ask()
    for k, v in {"family": "wmma", "status": "compile_error", "kind": "compile", "config": {"BM": 64},
                 "reason": f"nvcc exit 2: /tmp/d/kernel.cu(3): error: bad\n{secret}(1): error: {MARKER}"}.items():
        trial.set_user_attr(k, v)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    text = "\n".join(gather(storage, "wmma"))
    assert "kernel.cu(3): error: bad" in text and MARKER not in text


# --- 5. reply parsing: linear, capped ----------------------------------------------------------

def attack(kind: str, size: int) -> str:
    unit = {"unterminated": "<<<<<<< SEARCH\n",
            "nested": "<<<<<<< SEARCH\nx\n=======\n",
            "dividers": "=======\n",
            "open_then_dividers": None,
            "fences": "```\n",
            "fence_langs": "```jinja\nx\n",
            "no_newlines": "<<<<<<< SEARCH =======",
            "crlf": "<<<<<<< SEARCH\r\nx\r\n=======\r\n"}[kind]
    text = "<<<<<<< SEARCH\n" + "x\n=======\n" * size if unit is None else unit * (size // len(unit) + 1)
    return text[:size]


KINDS = ["unterminated", "nested", "dividers", "open_then_dividers", "fences", "fence_langs", "no_newlines", "crlf"]


@pytest.mark.parametrize("size", [100_000, MAX_REPLY_CHARS])
@pytest.mark.parametrize("kind", KINDS)
def test_parser_is_linear_on_hostile_replies(kind, size):
    text = attack(kind, size)
    assert len(text) == size
    start = time.perf_counter()
    try:
        parse_reply(text)
    except EditError as exc:
        assert len(str(exc)) < 400
    assert time.perf_counter() - start < 1.0, kind


def test_replies_over_the_cap_are_refused_unread():
    with pytest.raises(EditError, match="over the 262144 limit"):
        parse_reply("x" * (MAX_REPLY_CHARS + 1))


def test_good_replies_still_parse():
    good = after_pad("constexpr int UNROLL_HINT = {{ UNROLL_HINT }};") + \
        "```yaml\nknobs:\n  UNROLL_HINT: {values: [1, 2], default: 1}\n```\n"
    fenced = "Sure.\n```cuda\n" + good.replace("```yaml", "```\n```yaml", 1)  # blocks in a fence of their own
    for text in (good, good.replace("\n", "\r\n"), fenced):
        prop = parse_reply(text)
        assert prop.edits == [(PAD_LINE, PAD_LINE + "\nconstexpr int UNROLL_HINT = {{ UNROLL_HINT }};")]
        assert prop.knobs == {"UNROLL_HINT": {"values": [1, 2], "default": 1}}
    whole = parse_reply("```jinja\n" + WMMA + "```\n")
    assert whole.whole == WMMA and not whole.edits
    with pytest.raises(EditError, match="not closed"):
        parse_reply(after_pad("x").removesuffix(">>>>>>> REPLACE\n"))


@pytest.mark.parametrize("reply, status, needle", [
    ("<<<<<<< SEARCH\n" * 6_700, "bad_reply", "SEARCH marker inside"),  # 100 KB
    ("x" * (MAX_REPLY_CHARS + 1), "bad_reply", "over the 262144 limit"),
    ("<<<<<<< SEARCH\n" * (MAX_REPLY_CHARS // 15), "bad_reply", "SEARCH marker inside"),
    # A YAML alias bomb as a knob default: its repr would be exponential.
    (after_pad("x") + "```yaml\na: &a [1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e]\n"
     "knobs:\n  BOMB: {values: [1, 2], default: *f}\n```\n", "bad_edit", "default list not among"),
    (after_pad("x") + "```yaml\nknobs:\n  " + "9" * 5000 + ": {values: [1]}\n```\n", "bad_reply", "yaml"),
    (after_pad("x") + "```yaml\nknobs: " + "[" * 50_000 + "\n```\n", "bad_reply", "yaml"),  # deep nesting
    (after_pad("x") + "```yaml\nknobs:\n  MANY: {values: " + str(list(range(5000))) + "}\n```\n", "bad_edit",
     "at most 32"),  # each value would be compiled
])
def test_hostile_replies_end_as_outcomes(server, tmp_path, reply, status, needle):
    serve(completion(reply))
    start = time.perf_counter()
    (out,) = run(server, tmp_path)
    assert out.status == status and needle in out.reason, out
    assert time.perf_counter() - start < 5.0
    assert list_proposals(tmp_path)[0]["status"] == status


# --- 6. endpoint bodies that are no chat completion; a trickling server -------------------------

BODIES = {
    "not_json": (b"this is not json", "application/json", "endpoint_error", "not JSON"),
    "not_utf8": (b"\xff\xfe{\"choices\": \xc3\x28}", "application/json", "endpoint_error", "not UTF-8"),
    "utf8_surrogate_bytes": (b'{"choices": "\xed\xa0\x80"}', "application/json", "endpoint_error", "not UTF-8"),
    "html": (b"<!doctype html><html><body><h1>502 Bad Gateway</h1></body></html>", "text/html",
             "endpoint_error", "HTML page"),
    "empty": (b"", "application/json", "endpoint_error", "not JSON"),
    "no_choices": (b'{"object": "error", "message": "quota"}', "application/json", "endpoint_error", "no 'choices'"),
    "choices_empty": (b'{"choices": []}', "application/json", "endpoint_error", "no 'choices'"),
    "choices_not_list": (b'{"choices": {"0": 1}}', "application/json", "endpoint_error", "no 'choices'"),
    "choice_not_object": (b'{"choices": ["hi"]}', "application/json", "endpoint_error", "no 'choices'"),
    "no_message": (b'{"choices": [{"text": "hi"}]}', "application/json", "endpoint_error", "no 'message'"),
    "content_null": (completion(None), "application/json", "endpoint_error", "content is null"),
    "content_int": (completion(42), "application/json", "endpoint_error", "JSON int"),
    "content_list": (completion([{"type": "text", "text": "hi"}]), "application/json", "endpoint_error", "JSON list"),
    "content_object": (completion({"a": 1}), "application/json", "endpoint_error", "JSON dict"),
    "top_level_list": (b"[1, 2, 3]", "application/json", "endpoint_error", "no 'choices'"),
    "deep_nesting": (b"[" * 200_000, "application/json", "endpoint_error", "not JSON"),
    "huge_int": (b'{"choices": ' + b"9" * 10_000 + b"}", "application/json", "endpoint_error", "not JSON"),
    "lone_surrogate": (completion("x").replace(b'"x"', b'"\\ud800 <<<<<<< SEARCH"'), "application/json",
                       "bad_reply", "lone surrogate"),
    "over_body_cap": (completion("x" * (5 << 20)), "application/json", "bad_reply", "over 4 MiB"),
}


@pytest.mark.parametrize("kind", list(BODIES))
def test_bad_bodies_become_outcomes_and_the_run_goes_on(server, tmp_path, kind):
    body, ctype, status, needle = BODIES[kind]
    serve(body, ctype=ctype)
    outs = run(server, tmp_path, rounds=2)
    assert [o.status for o in outs] == [status, status], outs
    for o in outs:
        assert needle in o.reason and "\n" not in o.reason and len(o.reason) < 600, o
    assert [r["status"] for r in list_proposals(tmp_path)] == [status, status]
    if kind == "lone_surrogate":  # what can be kept of it is kept
        assert (tmp_path / outs[0].id / "reply.txt").read_text().startswith("? <<<<<<< SEARCH")


@pytest.mark.parametrize("status, body, needle", [
    (401, b'{"error": {"message": "bad key \\u001b[2J\\u001b]0;owned\\u0007"}}', "HTTP 401"),
    (404, b"<html>\x1b[31mnot found</html>", "HTTP 404"),
    (500, b"<html>oops</html>", "not reachable after 2 tries: InternalServerError"),
])
def test_error_statuses_stop_the_run_with_one_line(server, tmp_path, status, body, needle):
    serve(body, status=status, ctype="text/html")
    client = ChatClient(server, "stub", timeout_s=5, retries=2)
    outs = run_rounds(load_space(ROOT / "space.yaml"), "wmma", [parse_shape("256x256x256")], client, rounds=3,
                      candidates=1, out_dir=tmp_path, versions_dir=tmp_path / "v")
    (out,) = outs  # the endpoint refuses us: nothing more is asked
    assert out.status == "endpoint_error" and needle in out.reason and "\n" not in out.reason, out
    assert not any(c in out.reason for c in ESCAPES)


def test_a_body_cut_short_is_an_endpoint_error(server, tmp_path):
    serve(completion("x")[:20], length=10_000)  # promises 10 kB, sends 20 bytes and hangs up
    (out,) = run(server, tmp_path, rounds=2)
    assert out.status == "endpoint_error" and "not reachable after 1 tries" in out.reason, out


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_server_is_cut_off_by_the_deadline(server, tmp_path, where):
    """One byte a second never trips a per-read timeout; the request's deadline ends it."""
    body = completion("hi")
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    # headers: even the status line comes a byte a second; body: the headers at once, then the body so
    serve(trickle=head + body, burst=len(head) if where == "body" else 0)
    start = time.perf_counter()
    (out,) = run(server, tmp_path, rounds=3, timeout_s=1.5)
    took = time.perf_counter() - start
    assert out.status == "endpoint_error" and "1.5 s deadline" in out.reason, out
    assert took < 6.0, took
    # The abandoned request's thread ends at the next byte or read timeout, whichever comes first.
    while [t for t in threading.enumerate() if t.name == "llm-request"] and time.perf_counter() - start < took + 2:
        time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name == "llm-request"], "a request thread outlived its deadline"


def test_parse_completion_direct():
    assert parse_completion(completion("ok")) == "ok"
    for raw in (b"\x80", b"null", b"{}", b'{"choices": [{"message": {"content": null}}]}'):
        with pytest.raises(Exception) as err:
            parse_completion(raw)
        assert type(err.value).__name__ == "EndpointError" and not err.value.fatal


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_propose_exits_1_with_one_line_when_the_endpoint_never_answers(server, tmp_path):
    serve(b"<html><body>maintenance</body></html>", ctype="text/html")
    res = cli("propose", "--family", "wmma", "--shape", "256x256x256", "--base-url", server, "--model", "stub",
              "--backend", "none", "--rounds", "2", "--out", str(tmp_path), "--storage", f"sqlite:///{tmp_path}/n.db")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the LLM endpoint never answered usefully: ") and "HTML" in last
    assert [r["status"] for r in list_proposals(tmp_path)] == ["endpoint_error", "endpoint_error"]


# --- 11. terminal escapes -------------------------------------------------------------------

ANSI_REPLY = ("<<<<<<< SEARCH\n\x1b[2J\x1b[H\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x9b31m\u202etxt.exe\r"
              "evil \x1bP+q\x1b\\ line\n=======\nx\n>>>>>>> REPLACE\n")


def test_terminal_safe_strips_escapes_and_controls():
    cleaned = terminal_safe(ANSI_REPLY)
    assert not any(c in cleaned for c in ESCAPES + ("\r", "\x00"))
    assert "evil" in cleaned and "line" in cleaned and "SEARCH" in cleaned
    assert terminal_safe("a\n\tb\x1b[0m", one_line=True) == "a b"
    assert terminal_safe("\ud800ok") == "ok"


def test_escapes_in_a_reply_reach_no_record_or_log(server, tmp_path):
    serve(completion(ANSI_REPLY))
    lines: list[str] = []
    (out,) = run(server, tmp_path, rounds=1, log=lines.append)
    assert out.status == "bad_edit" and "evil" in out.reason, out
    folder = tmp_path / out.id
    for text in (out.reason, (folder / "outcome.json").read_text(), (folder / "log.txt").read_text(), *lines):
        assert not any(c in text for c in ESCAPES), repr(text)
    assert json.loads((folder / "outcome.json").read_text())["status"] == "bad_edit"


def test_escapes_never_reach_the_terminal_through_the_cli(server, tmp_path):
    serve(completion(ANSI_REPLY))
    res = cli("propose", "--family", "wmma", "--shape", "256x256x256", "--base-url", server, "--model", "stub",
              "--backend", "none", "--out", str(tmp_path), "--storage", f"sqlite:///{tmp_path}/n.db")
    assert res.returncode == 0, res.stderr
    assert "bad_edit" in res.stdout and not any(c in res.stdout + res.stderr for c in ESCAPES)
    # A tampered record: `proposals` prints it without its escapes.
    bad = tmp_path / "x-r0c0"
    bad.mkdir()
    (bad / "outcome.json").write_text(json.dumps({"id": "\x1b[2Jid", "round": "\x1b]0;t\x07", "status": "\x9b1m",
                                                  "reason": "\x1b[31mred\u202e", "metrics": "\x1b"}))
    res = cli("proposals", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "red" in res.stdout and not any(c in res.stdout + res.stderr for c in ESCAPES)


@pytest.mark.nvcc
@pytest.mark.parametrize("trap", ['asm volatile("tr" "ap;");', "__trap();", "__brkpt();",
                                  '#define T asm volatile("trap;")\n  T;'])
def test_a_trap_in_any_spelling_is_refused_from_the_sass(tmp_path, trap):
    """The source check matches `asm("trap")` literally; split literals, intrinsics and macros pass
    it. The built cubin's SASS cannot hide one: every spelling is a BPT instruction."""
    from proposer.validate import sass_traps
    from tuner.build import compile_source

    src = ('#include <cuda_fp16.h>\nextern "C" __global__ void hgemm(const __half* A, const __half* B, __half* C, '
           'int M, int N, int K, int s) {\n  if (M == 7) {\n  ' + trap + '\n  }\n}\n')
    res = compile_source(src, "sm_90a", cache_dir=tmp_path)
    assert res.ok, res.error
    assert sass_traps(res.cubin) >= 1
    clean = compile_source(src.replace(trap, ""), "sm_90a", cache_dir=tmp_path)
    assert sass_traps(clean.cubin) == 0
