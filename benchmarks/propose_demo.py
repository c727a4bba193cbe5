"""One propose round against a loopback OpenAI-compatible stub that replies with a hand-written
template improvement (benchmarks/proposals/*.md), through the real CLI. On a GPU the child is
rendered, checked, compiled, verified, tuned against its parent and accepted or rejected on the
measured numbers; without one it ends "not_evaluated: no GPU". Prints the round log.

    python benchmarks/propose_demo.py --shape 4096x4096x512 --out runs/propose_demo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tuner.shapes import parse_shape

ROOT = Path(__file__).resolve().parent.parent


def serve(reply: str) -> tuple[ThreadingHTTPServer, list[dict]]:
    """A chat-completions endpoint on 127.0.0.1 that answers every request with `reply`."""
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            requests.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            body = json.dumps({"id": "demo", "object": "chat.completion", "created": int(time.time()),
                               "model": "stub", "choices": [{"index": 0, "finish_reason": "stop",
                                                             "message": {"role": "assistant", "content": reply}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, requests


def replay_evidence(replay: Path, family: str, storage: str, trials: int = 8) -> None:
    """Fill `storage` with short studies of `family` answered from a file of real H200
    measurements, so that the prompt shows best results, losses to cuBLAS and errors."""
    from tuner.bench import ReplayBackend
    from tuner.search import tune
    from tuner.space import load_space

    backend = ReplayBackend(replay, "sm_90a")
    space = load_space(ROOT / "space.yaml")
    for shape in sorted({s for s, _ in backend.records if "/" not in s}):  # fp32 accumulation only
        tune(space, [family], parse_shape(shape), backend, trials=trials, storage=storage, seed=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reply", default=str(ROOT / "benchmarks" / "proposals" / "cute_sm80_epi_fast.md"))
    ap.add_argument("--family", default="cute_sm80")
    ap.add_argument("--shape", action="append", help="target shape(s), comma-separated or repeated; "
                                                    "default 4096x4096x512")
    ap.add_argument("--trials", type=int, default=8, help="trials of the parent's and the child's short tune")
    ap.add_argument("--out", default="runs/propose_demo", help="proposal records and any accepted version")
    ap.add_argument("--backend", default="auto", help="auto | gpu | none")
    ap.add_argument("--evidence", default=str(ROOT / "tests" / "data" / "replay_h200_bench7.jsonl"),
                    help="replay file of real measurements whose short studies the prompt reports ('' for none)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    storage = f"journal:{out.resolve()}/evidence.journal"  # an Optuna journal file: fast to fill
    if args.evidence:
        t0 = time.perf_counter()
        replay_evidence(Path(args.evidence), args.family, storage)
        print(f"evidence: replayed studies of {args.family} in {storage} ({time.perf_counter() - t0:.0f} s)")
    srv, requests = serve(Path(args.reply).read_text())
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    cmd = [sys.executable, "-m", "tuner.cli", "propose", "--family", args.family, "--rounds", "1",
           "--candidates", "1", "--base-url", url, "--model", "stub", "--trials", str(args.trials),
           "--backend", args.backend, "--out", str(out / "proposals"), "--versions-dir", str(out / "versions"),
           "--storage", storage]
    for s in ",".join(args.shape or ["4096x4096x512"]).split(","):
        cmd += ["--shape", s.strip()]
    print("$ " + " ".join(cmd[2:]), flush=True)
    start = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
    srv.shutdown()
    print(f"\npropose exited {rc} after {time.perf_counter() - start:.0f} s; the stub served {len(requests)} "
          f"request(s)", flush=True)
    for outcome in sorted((out / "proposals").glob("*/outcome.json")):
        folder = outcome.parent
        prompt = (folder / "prompt.txt").read_text()
        evidence = prompt[prompt.index("Results so far:"):prompt.index("Last attempts")]
        print(f"\n--- prompt {folder.name} (excerpt) ---\n{evidence}", end="")
        print(f"--- round log {folder.name} ---\n{(folder / 'log.txt').read_text()}", end="")
        print(json.dumps(json.loads(outcome.read_text())["metrics"], indent=1, default=str))
    for lineage in sorted((out / "versions").glob("*.lineage.json")):
        print(f"\nnew family version: {lineage.with_suffix('').with_suffix('')}.cu.j2 (lineage {lineage})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
