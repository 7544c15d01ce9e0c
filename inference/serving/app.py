"""The OpenAI-compatible HTTP API over the engine (FastAPI).

`POST /v1/chat/completions` and `/v1/completions`, streamed (server-sent events, one chunk per verified
piece of text, then `data: [DONE]`) or not; `GET /v1/models`, `/v1/models/{id}`, `/health` (liveness),
`/ready` (readiness), `/metrics`. Every error is a JSON body in OpenAI's shape, `{"error": {"message",
"type", "param", "code"}}`, with a 4xx status for the client's mistakes (401 key, 400 request, 404 model or
path, 405 method, 429 queue full) and 503 when the decoder failed.

Every field is checked here against what the ranks accept (seeds in torch's 64-bit range, finite sampling
values, text that is valid Unicode, prompt + max_tokens within the context), so no request can reach the
pipeline and fail there. A request whose client disconnects is cancelled the moment the disconnect arrives
(`_watch`), streamed or not, even while its events keep coming.
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
from typing import Annotated, Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from inference.sampling import Sampling, SamplingError
from inference.serving.engine import Engine, QueueFull, Request
from spd_lightning.errors import first_line

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes (`pipeline.generator_seeds` keeps it there)
MAX_STOP_STRINGS = 4  # as OpenAI's API
MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN = 1 << 20, 64  # a body that fills the context, JSON-escaped, fits
MAX_BODY_BYTES = 64 << 20  # when the context is unknown
MAX_STOP_CHARS = 256  # the text stream checks every prefix of a stop string at each cycle
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


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


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart]

    def rendered(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with no choices and the usage, as OpenAI's API


class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=2**31 - 1)  # an extension of OpenAI's API; 0 keeps every token
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StopText | list[StopText] | None = Field(None, max_length=MAX_STOP_STRINGS)
    n: int = Field(1, ge=1, le=1)
    stream_options: StreamOptions | None = None


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
        body = await _parse(http, ChatRequest, config)
        ids = _tokenized(lambda: _render_chat(tokenizer, [m.rendered() for m in body.messages]))
        return await _complete(engine, config, body, ids, http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await _parse(http, CompletionRequest, config)
        ids = _tokenized(lambda: tokenizer(body.prompt)["input_ids"])
        return await _complete(engine, config, body, ids, http, chat=False)

    return app


def _add_errors_and_auth(app: FastAPI, config: ServerConfig) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # unknown path (404), wrong method (405)
        return error_response(
            e.status_code, str(e.detail), "invalid_request_error", "not_found" if e.status_code == 404 else None
        )

    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key)


class ApiKey:
    """`Authorization: Bearer KEY` on /v1/*. A pure ASGI middleware: it leaves `receive` alone, so a handler
    still sees its client's disconnect (`_watch`). The header is compared as bytes: it may hold any byte."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"").removeprefix(b"Bearer ").strip()
            if not secrets.compare_digest(given, self.key):
                reply = error_response(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer KEY`",
                    "invalid_request_error",
                    "invalid_api_key",
                )
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_info_routes(app: FastAPI, engine: Engine, config: ServerConfig) -> None:
    model = {"id": config.model, "object": "model", "created": 0, "owned_by": "spd-lightning"}

    @app.get("/health")
    async def health():
        """Liveness: the server answers (a restarting pipeline is not a reason to restart the server)."""
        return {"status": "ok", "ready": engine.ready, "queue_depth": engine.queue_depth}

    @app.get("/ready")
    async def ready():
        """Readiness: the pipeline is up and loaded and can take a request now."""
        ok = engine.ready
        return JSONResponse(
            {"status": "ready" if ok else "starting", "queue_depth": engine.queue_depth}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine.queue_depth, engine.mode, engine.ready))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name != config.model:
            raise ApiError(
                404,
                f"model {name!r} does not exist: this server serves {config.model!r}",
                code="model_not_found",
                param="model",
            )
        return model


async def _body(http: HttpRequest, limit: int) -> bytes:
    """The body, read no further than `limit` bytes: what a client sends never sizes the server's memory."""
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(http: HttpRequest, schema: type[_Sampled], config: ServerConfig) -> _Sampled:
    """The JSON body (whatever its content type says: `curl -d` sends no JSON type) checked against `schema`."""
    limit = max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * config.context) if config.context else MAX_BODY_BYTES
    try:
        data = json.loads(await _body(http, limit))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_unicode(data, "")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where or 'body'}: {first['msg']}", code="invalid_request", param=where or None) from None


def _check_unicode(value, where: str) -> None:
    """JSON may escape a lone surrogate (`"\\ud800"`), which no tokenizer can encode: a 400, not a crash."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400, f"{where or 'body'}: not valid Unicode (a lone surrogate)", param=where or None
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}.{i}")


def _tokenized(tokenize) -> list[int]:
    try:
        return list(tokenize())
    except (ValueError, TypeError, UnicodeError) as e:  # e.g. a template that refuses the conversation
        raise ApiError(
            400,
            f"the prompt cannot be tokenized: {first_line(e)}",
            param="messages",
        ) from None


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
    if config.context and len(ids) + max_tokens > config.context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together more than the target's "
            f"context of {config.context}; shorten the prompt or lower max_tokens",
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
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(request, head, chat, http, usage), media_type="text/event-stream")
    return await _whole(request, head, chat, http)


async def _events(request: Request, http: HttpRequest):
    """The request's events until `done`; cancels the request the moment the client disconnects."""
    watcher = asyncio.create_task(_watch(request, http))
    try:
        while True:
            event = await request.events.get()
            yield event
            if event[0] in ("done", "error"):
                return
    finally:
        watcher.cancel()
        request.cancel()  # a no-op once the decode has finished


async def _watch(request: Request, http: HttpRequest) -> None:
    """Wait for the disconnect (the body is read, so `receive` returns only when the client goes), then
    cancel, whatever the request's events are doing meanwhile; the waiting handler sees an `error`."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    request.cancel()
    request.emit("error", 499, "the client disconnected")


async def _whole(request: Request, head: dict, chat: bool, http: HttpRequest):
    text, finish, usage = [], None, None
    async for event in _events(request, http):
        if event[0] == "text":
            text.append(event[1])
        elif event[0] == "error":
            raise ApiError(event[1], event[2], "server_error", "decoder_failed")
        else:
            finish, usage = event[1], _usage(*event[2:])
    content = "".join(text)
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
    )
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse(request: Request, head: dict, chat: bool, http: HttpRequest, usage: bool) -> AsyncIterator[str]:
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
            if usage:
                yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': _usage(*event[2:])})}\n\n"
    yield "data: [DONE]\n\n"
