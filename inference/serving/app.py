"""The OpenAI-compatible HTTP API over the engine (FastAPI): the routes, the error bodies and statuses, and
`/openapi.json` (the schema of exactly what it accepts and answers, `api_models`) of docs/SERVING.md, "The API".

The event loop only moves bytes: a body is read up to its size limit, then checked and tokenized on the
intake's worker threads (`intake`). A request whose client disconnects is cancelled the moment the disconnect
arrives (`_watch`), streamed or not, even while its events keep coming.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from inference.serving import api_models as models
from inference.serving.engine import Engine, Generation, QueueFull
from inference.serving.intake import ApiError, Intake, Limits, unknown_model
from inference.serving.logs import completion_id

log = logging.getLogger("inference.serve")
MAX_RETRY_AFTER_S = 60


class ModelId(PathConvertor):
    """A model id in a path: it may hold slashes (`--model-name Qwen/Qwen3-8B`, which clients send unescaped),
    but no empty segment, so that a trailing slash still redirects as on any route."""

    regex = "[^/]+(?:/[^/]+)*"


register_url_convertor("model_id", ModelId())


@dataclass
class ServerConfig(Limits):
    """What the intake checks (`Limits`: model name, token caps, context), plus the server's own settings."""

    api_key: str | None = None
    access_log: bool = False  # one line per HTTP request (method, path, status, seconds, completion id)


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app over `engine`: auth, info routes, and the two completion routes."""
    intake = Intake(engine.tokenizer, config)

    @asynccontextmanager
    async def lifespan(_):
        yield
        intake.close()
        await asyncio.to_thread(engine.close)  # on SIGTERM too: the ranks leave cleanly before the process exits

    app = FastAPI(title="SPD-Lightning", docs_url=None, redoc_url=None, lifespan=lifespan)
    _add_errors_and_auth(app, config)
    _add_info_routes(app, engine, config)

    @app.post("/v1/chat/completions", **_operation(models.ChatRequest, models.ChatCompletion, config))
    async def chat(http: HttpRequest):
        return await _complete(engine, intake, config, http, chat=True)

    @app.post("/v1/completions", **_operation(models.CompletionRequest, models.Completion, config))
    async def completions(http: HttpRequest):
        return await _complete(engine, intake, config, http, chat=False)

    _publish_schema(app, config)
    return app


SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}  # one event
ERRORS = {
    400: "a malformed body or a bad or unsupported field",
    401: "a missing or wrong API key",
    404: "an unknown model",
    413: "a body over the size limit",
    429: "the queue is full (see Retry-After)",
    503: "the decoder failed or the server is stopping",
}


def _operation(body_model: type, reply: type, config: ServerConfig) -> dict:
    """What the schema says of a completion route: its JSON body, its answers (JSON, or server-sent events when
    `stream` is true) and its errors. The handler reads the body itself (size first, then off the loop)."""
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body_model.__name__}"}}},
            },
        },
        "responses": {
            200: {
                "model": reply,
                "content": {"text/event-stream": {"schema": SSE_EVENT}},
                "description": "the completion, or its chunks as server-sent events",
            },
            **_errors(config, *ERRORS),
        },
    }


def _errors(config: ServerConfig, *statuses: int) -> dict:
    """The schema's error responses of a route among `statuses` (401 only when a key is required)."""
    return {s: {"model": models.ErrorBody, "description": ERRORS[s]} for s in statuses if s != 401 or config.api_key}


def _publish_schema(app: FastAPI, config: ServerConfig) -> None:
    """`/openapi.json` with the request and error models FastAPI cannot see (the handlers parse the body), the
    one model name accepted, and the key, when one is set, as a bearer scheme."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (models.ChatRequest, models.CompletionRequest, models.ErrorBody):
            found = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(found.pop("$defs", {}))
            if "model" in found["properties"]:
                found["properties"]["model"] = {"type": "string", "enum": [config.model]}
                for name in ("max_tokens", "max_completion_tokens"):
                    limited = {"type": "integer", "minimum": 1, "maximum": config.max_tokens_cap}
                    found["properties"][name] = {"anyOf": [limited, {"type": "null"}], "default": None}
            components[model.__name__] = found
        if config.api_key:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in schema["paths"].items():
                if path.startswith("/v1/"):
                    for operation in item.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _add_errors_and_auth(app: FastAPI, config: ServerConfig) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # unknown path (404), wrong method (405)
        code = "not_found" if e.status_code == 404 else None
        return error_response(ApiError(e.status_code, str(e.detail), code=code, headers=e.headers))

    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key)
    if config.access_log:
        app.add_middleware(AccessLog)


class ApiKey:
    """`Authorization: Bearer KEY` on /v1/*, per RFC 6750: the scheme in any case, one space or more, exactly one
    such header (two are a 400). A pure ASGI middleware: it leaves `receive` alone, so a handler still sees its
    client's disconnect (`_watch`). The key is compared as bytes, in constant time: it may hold any byte."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refusal = self._refusal([v for k, v in scope["headers"] if k == b"authorization"])
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, values: list[bytes]) -> JSONResponse | None:
        if len(values) > 1:
            return error_response(ApiError(400, "send one Authorization header, not several"))
        scheme, _, token = values[0].partition(b" ") if values else (b"", b"", b"")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(b" "), self.key):
            return None
        message = "missing or wrong API key: send `Authorization: Bearer KEY`"
        challenge = 'Bearer error="invalid_token"' if values else "Bearer"
        return error_response(ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge}))


class AccessLog:
    """One line per HTTP request once it is answered: method, path, status, seconds, and the completion id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [0]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        token = completion_id.set("-")
        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            log.info(
                "%s %s %s %d %.3f s",
                client[0],
                scope["method"],
                scope["path"],
                status[0],
                time.perf_counter() - started,
            )
            completion_id.reset(token)


def _add_info_routes(app: FastAPI, engine: Engine, config: ServerConfig) -> None:
    model = {"id": config.model, "object": "model", "created": 0, "owned_by": "spd-lightning"}

    @app.get("/health", response_model=models.Health)
    async def health():
        """Liveness: the server answers (a restarting pipeline is not a reason to restart the server)."""
        return {"status": "ok", "ready": engine.ready, "queue_depth": engine.queue_depth}

    @app.get("/ready", response_model=models.Readiness, responses={503: {"model": models.Readiness}})
    async def ready():
        """Readiness: the pipeline is up and loaded and can take a request now."""
        ok = engine.ready
        return JSONResponse(
            {"status": "ready" if ok else "starting", "queue_depth": engine.queue_depth}, status_code=200 if ok else 503
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(engine.metrics.render(engine.queue_depth, engine.mode, engine.ready))

    @app.get("/v1/models", response_model=models.ModelList, responses=_errors(config, 401))
    async def list_models():
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{name:model_id}", response_model=models.Model, responses=_errors(config, 401, 404))
    async def one_model(name: str):
        if name != config.model:
            raise unknown_model(name, config.model)
        return model


async def _body(http: HttpRequest, limit: int) -> bytes:
    """The body, read no further than `limit` bytes (refused at once when its declared length is over it): what
    a client sends never sizes the server's memory."""
    too_large = ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body ended: answered as any disconnect, not a 500 and a traceback
        raise ApiError(499, "the client disconnected") from None
    return b"".join(chunks)


async def _complete(engine: Engine, intake: Intake, config: ServerConfig, http: HttpRequest, chat: bool):
    accepted = await intake.accept(await _body(http, config.body_bytes), chat)
    body = accepted.body
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": config.model,
    }
    completion_id.set(head["id"])
    loop = asyncio.get_running_loop()
    generation = Generation(list(accepted.ids), accepted.max_tokens, accepted.sampling, seed, stop, loop, head["id"])
    try:
        engine.submit(generation)
    except QueueFull:
        raise ApiError(
            429,
            "the server is busy: every place in its queue is taken, retry later",
            "rate_limit_error",
            "queue_full",
            headers={"Retry-After": str(_retry_after(engine, config))},
        ) from None
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(generation, head, chat, http, usage), media_type="text/event-stream")
    return await _whole(generation, head, chat, http)


def _retry_after(engine: Engine, config: ServerConfig) -> int:
    """Seconds until a place frees up, roughly: the queue ahead of it, a default decode each, over the slots."""
    per_token = engine.seconds_per_token() or 0.05
    wait = per_token * config.default_max_tokens * engine.queue_depth / engine.max_batch
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait)))


async def _events(generation: Generation, http: HttpRequest):
    """The generation's `text` events until `done`, or the `ApiError` of its `error` event (status, message,
    code); cancels it the moment the client disconnects."""
    watcher = asyncio.create_task(_watch(generation, http))
    try:
        while True:
            event = await generation.events.get()
            if event[0] == "error":
                raise ApiError(event[1], event[2], "server_error", event[3])
            yield event
            if event[0] == "done":
                return
    finally:
        watcher.cancel()
        generation.cancel()  # a no-op once the decode has finished


async def _watch(generation: Generation, http: HttpRequest) -> None:
    """Wait for the disconnect (the body is read, so `receive` returns only when the client goes), then
    cancel, whatever the generation's events are doing meanwhile; the waiting handler sees an `error`."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()
    generation.emit("error", 499, "the client disconnected", "client_disconnected")


async def _whole(generation: Generation, head: dict, chat: bool, http: HttpRequest):
    text, finish, usage = [], None, None
    async for event in _events(generation, http):
        if event[0] == "text":
            text.append(event[1])
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


async def _sse(generation: Generation, head: dict, chat: bool, http: HttpRequest, usage: bool) -> AsyncIterator[str]:
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
    try:
        async for event in _events(generation, http):
            if event[0] == "text":
                yield chunk(event[1], None)
            else:
                yield chunk(None, event[1])
                if usage:
                    yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': _usage(*event[2:])})}\n\n"
    except ApiError as failed:
        yield f"data: {json.dumps(error_body(failed))}\n\n"
        return
    yield "data: [DONE]\n\n"
