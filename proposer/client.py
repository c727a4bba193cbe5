"""An OpenAI-compatible chat endpoint (hosted, vLLM, llama.cpp server) via the openai package.

The endpoint is untrusted like the model: its answer is read with a size cap and a wall-clock
deadline per request (httpx's timeouts are per read: a server trickling a byte a second would
never trip them), and parsed strictly. Every failure is an `EndpointError` or a `BadReply`
with a one-line reason, never another exception."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from proposer.validate import terminal_safe
from tuner.errors import UserError

MAX_BODY_BYTES = 4 << 20  # a chat completion of a 256 KiB reply, JSON-escaped, fits with room to spare


class EndpointError(UserError):
    """No usable chat completion came back. `fatal`: the endpoint is unreachable or refuses us
    (asking again this run is pointless); otherwise it answered with something that is not one."""

    def __init__(self, message: str, fatal: bool = True):
        super().__init__(terminal_safe(message, one_line=True)[:500])
        self.fatal = fatal


class BadReply(UserError):
    """A chat completion whose text cannot be used; `text` is what can be recorded of it."""

    def __init__(self, message: str, text: str = ""):
        super().__init__(terminal_safe(message, one_line=True)[:500])
        self.text = text


class _Deadline(Exception):
    pass


class _TooLarge(Exception):
    pass


class ChatClient:
    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3):
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        self.model = model or os.environ.get("OPENAI_MODEL")
        self.key = api_key or os.environ.get("OPENAI_API_KEY") or "none"  # local servers take any key
        if not self.base_url and not os.environ.get("OPENAI_API_KEY"):
            raise UserError("no LLM endpoint configured: pass --base-url (or set OPENAI_BASE_URL) "
                            "and --model, or set OPENAI_API_KEY for the hosted API")
        if not self.model:
            raise UserError("no model given: pass --model (or set OPENAI_MODEL)")
        if not timeout_s > 0:
            raise UserError(f"the request timeout must be positive, got {timeout_s}")
        try:
            import openai
        except ImportError:
            raise UserError("the proposer needs the openai package: pip install 'hgemm-tune[llm]'") from None
        self.openai = openai
        self.timeout_s = timeout_s
        self.retries = max(1, retries)

    def chat(self, system: str, user: str) -> str:
        """The reply text; retries with backoff on timeouts, the deadline and server errors."""
        import httpx2 as httpx  # the openai package's own HTTP client

        openai = self.openai
        last = "no try made"
        for attempt in range(self.retries):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1) * 0.5, 8.0))
            try:
                body = self._request(system, user)
            except _Deadline:
                last = f"no complete answer within the {self.timeout_s:g} s deadline"
            except _TooLarge:
                raise BadReply(f"the endpoint's answer is over {MAX_BODY_BYTES >> 20} MiB: not read further") from None
            except (openai.APITimeoutError, openai.APIConnectionError, openai.InternalServerError,
                    openai.RateLimitError, httpx.TransportError) as exc:  # transport: a body cut short
                last = f"{type(exc).__name__}: {_short(exc)}"
            except openai.APIStatusError as exc:
                raise EndpointError(f"LLM endpoint {self.base_url} refused the request: HTTP {exc.status_code}: "
                                    f"{_short(exc)}") from None
            except Exception as exc:  # noqa: BLE001 - anything else the client library raises on a hostile server
                raise EndpointError(f"LLM endpoint {self.base_url}: the request failed: "
                                    f"{type(exc).__name__}: {_short(exc)}") from None
            else:
                return parse_completion(body)
        raise EndpointError(f"LLM endpoint {self.base_url} not reachable after {self.retries} tries: {last}")

    def _request(self, system: str, user: str) -> bytes:
        """The raw body of one request, within the deadline (in a worker thread: the wait for the
        status line and headers is as unbounded as the body's) and under the size cap."""
        import httpx2 as httpx  # the openai package's own HTTP client

        client = self.openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0,
                                    timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)))
        done: dict[str, object] = {}

        def work() -> None:
            try:
                with client.chat.completions.with_streaming_response.create(
                        model=self.model, temperature=0.7,
                        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                        extra_headers={"Accept-Encoding": "identity"}) as resp:  # no decompression bombs
                    buf = bytearray()
                    for chunk in resp.iter_bytes():
                        buf += chunk
                        if len(buf) > MAX_BODY_BYTES:
                            raise _TooLarge
                        if "abandoned" in done:
                            return
                    done["body"] = bytes(buf)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                done["error"] = exc

        worker = threading.Thread(target=work, name="llm-request", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            done["abandoned"] = True
            with contextlib.suppress(Exception):  # best effort: the thread is a daemon
                client.close()  # drops the connection: the worker's blocked read fails and it ends
            raise _Deadline
        client.close()
        if "error" in done:
            raise done["error"]  # type: ignore[misc]
        return done["body"]  # type: ignore[return-value]


def parse_completion(body: bytes) -> str:
    """The message text of a chat completion body, or EndpointError / BadReply saying why not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EndpointError(f"the endpoint's answer is not UTF-8 (invalid byte at offset {exc.start})",
                            fatal=False) from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        looks = " (it looks like an HTML page)" if text.lstrip()[:1] == "<" else ""
        raise EndpointError(f"the endpoint's answer is not JSON{looks}: {len(body)} bytes", fatal=False) from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EndpointError("the endpoint's answer is not a chat completion: no 'choices' list", fatal=False)
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise EndpointError("the endpoint's answer is not a chat completion: choices[0] has no 'message'",
                            fatal=False)
    content = message.get("content")
    if content is None:
        raise EndpointError("the model's message has no text (content is null)", fatal=False)
    if not isinstance(content, str):
        raise EndpointError(f"the model's message content is a JSON {type(content).__name__}, not a string",
                            fatal=False)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadReply(f"the reply is not valid Unicode (a lone surrogate at character {exc.start})",
                       text=content.encode("utf-8", "replace").decode("utf-8")) from None
    return content


def _short(exc: BaseException) -> str:
    return terminal_safe(str(exc), one_line=True)[:200]
