"""An OpenAI-compatible chat endpoint (hosted, vLLM, llama.cpp server) via the openai package."""

from __future__ import annotations

import os
import time

from tuner.errors import UserError


class ChatClient:
    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 120.0, retries: int = 3):
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        self.model = model or os.environ.get("OPENAI_MODEL")
        key = api_key or os.environ.get("OPENAI_API_KEY") or "none"  # local servers take any key
        if not self.base_url and not os.environ.get("OPENAI_API_KEY"):
            raise UserError("no LLM endpoint configured: pass --base-url (or set OPENAI_BASE_URL) "
                            "and --model, or set OPENAI_API_KEY for the hosted API")
        if not self.model:
            raise UserError("no model given: pass --model (or set OPENAI_MODEL)")
        try:
            import openai
        except ImportError:
            raise UserError("the proposer needs the openai package: pip install 'hgemm-tune[llm]'") from None
        self.openai = openai
        self.client = openai.OpenAI(base_url=self.base_url, api_key=key, timeout=timeout_s, max_retries=0)
        self.retries = retries

    def chat(self, system: str, user: str) -> str:
        """The reply text; retries with backoff on timeouts and server errors."""
        last: Exception | None = None
        for attempt in range(self.retries):
            try:
                resp = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "system", "content": system},
                                                {"role": "user", "content": user}], temperature=0.7)
                return resp.choices[0].message.content or ""
            except (self.openai.APITimeoutError, self.openai.APIConnectionError,
                    self.openai.InternalServerError, self.openai.RateLimitError) as exc:
                last = exc
                time.sleep(min(2.0 ** attempt * 0.5, 8.0))
            except self.openai.APIError as exc:
                raise UserError(f"LLM endpoint {self.base_url} refused the request: {exc}") from None
        raise UserError(f"LLM endpoint {self.base_url} not reachable after {self.retries} tries: "
                        f"{type(last).__name__}: {last}")
