"""The OpenAI-compatible HTTP API over the engine (FastAPI).

`POST /v1/chat/completions` and `/v1/completions`, streamed (server-sent events, one chunk per verified
piece of text, then `data: [DONE]`) or not; `GET /v1/models`, `/health`, `/metrics`. Every error is a JSON
body in OpenAI's shape, `{"error": {"message", "type", "code"}}`, with a 4xx status for the client's
mistakes (401 key, 400 request, 404 model, 429 queue full) and 503 when the decoder failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inference.sampling import Sampling, SamplingError
from inference.serving.engine import Engine, QueueFull, Request

DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.code, self.param)


def error_response(status: int, message: str, kind: str, code: str | None = None, param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension of OpenAI's API; 0 keeps every token
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Sampled):
    prompt: str


@dataclass
class ServerConfig:
    model: str  # the name /v1/models lists and requests must use
    max_tokens_cap: int
    default_max_tokens: int
    context: int  # the target's context length (0: unknown)
    api_key: str | None = None


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app over `engine`: auth, info routes, and the two completion routes."""

    @asynccontextmanager
    async def lifespan(_):
        yield
        await asyncio.to_thread(engine.close)  # on SIGTERM too: the ranks leave cleanly before the process exits

    app = FastAPI(title="SPD-Lightning", docs_url=None, redoc_url=None, lifespan=lifespan)
    tokenizer = engine.tokenizer
    _add_errors_and_auth(app, config)
    _add_info_routes(app, engine, config)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        body = await _parse(http, ChatRequest)
        ids = _render_chat(tokenizer, [m.model_dump() for m in body.messages])
        return await _complete(engine, config, body, ids, http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await _parse(http, CompletionRequest)
        ids = tokenizer(body.prompt)["input_ids"]
        return await _complete(engine, config, body, ids, http, chat=False)

    return app


def _add_errors_and_auth(app: FastAPI, config: ServerConfig) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return e.response()

    @app.middleware("http")
    async def _authorize(request: HttpRequest, call_next):
        if config.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given, config.api_key):
                return error_response(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer KEY`",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        return await call_next(request)


def _add_info_routes(app: FastAPI, engine: Engine, config: ServerConfig) -> None:
    @app.get("/health")
    async def health():
        ok = engine.backend is not None
        return JSONResponse(
            {"status": "ok" if ok else "restarting", "queue_depth": engine.queue_depth}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine.queue_depth, engine.mode))

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model, "object": "model", "created": 0, "owned_by": "spd-lightning"}],
        }


async def _parse(http: HttpRequest, schema: type[_Sampled]) -> _Sampled:
    """The JSON body (whatever its content type says: `curl -d` sends no JSON type) checked against `schema`."""
    try:
        data = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where or 'body'}: {first['msg']}", code="invalid_request", param=where or None) from None


def _render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation with the chat template, as `prompts.render` renders one user turn."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _check(config: ServerConfig, body: _Sampled, ids: list[int]) -> tuple[int, Sampling]:
    if body.model != config.model:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist: this server serves {config.model!r}",
            code="model_not_found",
            param="model",
        )
    max_tokens = next(
        (m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), config.default_max_tokens
    )
    if not 1 <= max_tokens <= config.max_tokens_cap:
        raise ApiError(400, f"max_tokens={max_tokens} must be in [1, {config.max_tokens_cap}]", param="max_tokens")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if config.context and len(ids) >= config.context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; the target's context is {config.context}",
            code="context_length_exceeded",
            param="messages",
        )
    try:
        return max_tokens, Sampling(body.temperature, body.top_k, body.top_p)
    except SamplingError as e:
        raise ApiError(400, str(e)) from None


async def _complete(
    engine: Engine, config: ServerConfig, body: _Sampled, ids: list[int], http: HttpRequest, chat: bool
):
    max_tokens, sampling = _check(config, body, ids)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
    request = Request(list(ids), max_tokens, sampling, seed, stop, asyncio.get_running_loop())
    try:
        engine.submit(request)
    except QueueFull:
        raise ApiError(
            429, "the server is busy: every place in its queue is taken, retry later", "rate_limit_error", "queue_full"
        ) from None
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": config.model,
    }
    if body.stream:
        return StreamingResponse(_sse(request, head, chat, http), media_type="text/event-stream")
    return await _whole(request, head, chat, http)


async def _events(request: Request, http: HttpRequest):
    """The request's events until `done`; cancels the request when the client disconnects."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(request.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return
                continue
            yield event
            if event[0] in ("done", "error"):
                return
    finally:
        request.cancelled.set()  # a no-op once the decode has finished


async def _whole(request: Request, head: dict, chat: bool, http: HttpRequest):
    text, finish, usage = [], None, None
    async for event in _events(request, http):
        if event[0] == "text":
            text.append(event[1])
        elif event[0] == "error":
            raise ApiError(event[1], event[2], "server_error", "decoder_failed")
        else:
            finish, usage = (
                event[1],
                {"prompt_tokens": event[2], "completion_tokens": event[3], "total_tokens": event[2] + event[3]},
            )
    content = "".join(text)
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
    )
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}


async def _sse(request: Request, head: dict, chat: bool, http: HttpRequest) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"

    if chat:
        yield chunk(None, None, role=True)
    async for event in _events(request, http):
        if event[0] == "text":
            yield chunk(event[1], None)
        elif event[0] == "error":
            body = {"error": {"message": event[2], "type": "server_error", "param": None, "code": "decoder_failed"}}
            yield f"data: {json.dumps(body)}\n\n"
            return
        else:
            yield chunk(None, event[1])
    yield "data: [DONE]\n\n"
