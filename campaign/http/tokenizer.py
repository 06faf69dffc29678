"""The measured server's own tokenizer, through vLLM's /tokenize and /detokenize: no tokenizer dependency here,
and no drift between the tokens a prompt was made of and the tokens the model sees.

vLLM serves both at the root (not under /v1): `{"model", "prompt"}` or `{"model", "messages",
"add_generation_prompt"}` -> `{"count", "max_model_len", "tokens"}`, and `{"model", "tokens"}` -> `{"prompt"}`.
"""

from __future__ import annotations

from typing import Any

import httpx

from campaign.core.errors import PromptError

TOKENIZE_TIMEOUT_S = 120.0   # a corpus of 1.5M characters is one request


class ServerTokenizer:
    def __init__(self, control: httpx.AsyncClient, model: str) -> None:
        self.control = control
        self.model = model

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        # A transport error is left as it is: the server may have died, and the runner relaunches on that.
        response = await self.control.post(path, json=body, timeout=TOKENIZE_TIMEOUT_S)
        if response.status_code == 404:
            raise PromptError(f"the server has no {path} endpoint (vLLM's): text prompts and the chat endpoint "
                              "are made with the server's own tokenizer",
                              hint="use --prompts random --endpoint completions against this server")
        if response.status_code != 200:
            raise PromptError(f"{path} answered HTTP {response.status_code}: {response.text[:300]}",
                              hint="text prompts need the server's tokenizer; use --prompts random")
        data = response.json()
        if not isinstance(data, dict):
            raise PromptError(f"{path} answered something that is not a JSON object: {response.text[:200]}")
        return data

    async def tokenize(self, *, prompt: str | None = None,
                       messages: list[dict[str, Any]] | None = None) -> list[int]:
        body: dict[str, Any] = {"model": self.model}
        if messages is not None:
            body |= {"messages": messages, "add_generation_prompt": True}
        else:
            body |= {"prompt": prompt or "", "add_special_tokens": False}
        tokens = (await self._post("/tokenize", body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise PromptError("/tokenize answered without a list of token ids",
                              hint="use --prompts random against this server")
        return tokens

    async def detokenize(self, ids: list[int]) -> str:
        text = (await self._post("/detokenize", {"model": self.model, "tokens": ids})).get("prompt")
        if not isinstance(text, str):
            raise PromptError("/detokenize answered without its text", hint="use --endpoint completions")
        return text
