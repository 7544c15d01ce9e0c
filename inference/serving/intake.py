"""From the bytes a client sent to token ids the engine can take, cheapest check first, off the event loop.

The order bounds what a request can cost before it is refused: the declared size (`Content-Length`), the
bytes read (never more than the limit), then on a worker thread (`Intake.pool`, a bound number of them) the
JSON nesting depth (a scan, before any recursive parser sees it), JSON, valid Unicode, the refused fields,
the schema, the model and `max_tokens`, a lower bound of the prompt's tokens from its length (so a prompt
that cannot fit is refused without tokenizing it), and last the template and the tokenizer. Each failure is
an `ApiError` in OpenAI's shape; nothing here can raise anything else for any body.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from jinja2 import TemplateError
from pydantic import ValidationError

from inference.sampling import Sampling
from inference.serving.api_models import ChatRequest, CompletionRequest, refused
from spd_lightning.data.chat import render_chat
from spd_lightning.errors import first_line

MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN = 1 << 20, 64  # a body that fills the context, JSON-escaped, fits
MAX_BODY_BYTES = 64 << 20  # when the context is unknown
MAX_JSON_DEPTH = 32  # a chat body nests 5 deep; Python's parsers recurse, and 1000 levels overflow them
INTAKE_WORKERS = 2  # parse + template + tokenize threads: a big body never blocks the event loop
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
SHOWN_CHARS = 100  # the most of a client's value an error message quotes


@dataclass(eq=False)  # hashed by identity, as exceptions are
class ApiError(Exception):
    status: int
    message: str
    kind: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)


def shown(text: str) -> str:
    """A client's value as an error quotes it: whole, or its first SHOWN_CHARS characters and an ellipsis (a
    body may hold megabytes: the answer, and a log that keeps it, never echo them)."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}…"


def unknown_model(name: str, served: str) -> ApiError:
    """The 404 of a request (or `/v1/models/{name}`) that names another model than the one served."""
    message = f"model {shown(name)!r} does not exist: this server serves {served!r}"
    return ApiError(404, message, code="model_not_found", param="model")


@dataclass
class Limits:
    model: str  # the name /v1/models lists and requests must use
    max_tokens_cap: int
    default_max_tokens: int
    context: int  # the target's context length (0: unknown)

    @property
    def body_bytes(self) -> int:
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * self.context) if self.context else MAX_BODY_BYTES


@dataclass
class Accepted:
    body: ChatRequest | CompletionRequest
    ids: list[int]
    max_tokens: int
    sampling: Sampling


class Intake:
    def __init__(self, tokenizer, limits: Limits):
        self.tokenizer, self.limits = tokenizer, limits
        self.pool = ThreadPoolExecutor(INTAKE_WORKERS, thread_name_prefix="spd-intake")
        # No token covers more characters than the longest vocabulary entry: a prompt longer than the context
        # times that cannot fit, whatever it tokenizes to.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.chars_per_token = max((len(t) for t in vocab), default=0)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def accept(self, raw: bytes, chat: bool) -> Accepted:
        """`raw` checked and tokenized on the pool (the loop only awaits it)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._accept, raw, chat)

    def _accept(self, raw: bytes, chat: bool) -> Accepted:
        body = parse(raw, ChatRequest if chat else CompletionRequest)
        max_tokens, sampling = self._settings(body)
        if chat:
            messages = [m.rendered() for m in body.messages]
            self._fits([m["content"] for m in messages], max_tokens)
            ids = _tokenized(lambda: _render_chat(self.tokenizer, messages))
        else:
            self._fits([body.prompt], max_tokens)
            ids = _tokenized(lambda: self.tokenizer(body.prompt)["input_ids"])
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if self.limits.context and len(ids) + max_tokens > self.limits.context:
            raise self._too_long(f"the prompt has {len(ids)} tokens", max_tokens)
        return Accepted(body, ids, max_tokens, sampling)

    def _settings(self, body) -> tuple[int, Sampling]:
        limits = self.limits
        if body.model != limits.model:
            raise unknown_model(body.model, limits.model)
        fields = (("max_completion_tokens", body.max_completion_tokens), ("max_tokens", body.max_tokens))
        sent = [(name, value) for name, value in fields if value is not None]  # the first sent wins
        name, max_tokens = sent[0] if sent else ("max_tokens", limits.default_max_tokens)
        if not 1 <= max_tokens <= limits.max_tokens_cap:
            message = f"{name}={shown(str(max_tokens))} must be in [1, {limits.max_tokens_cap}]"
            raise ApiError(400, message, param=name)  # the field the client sent
        return max_tokens, Sampling(body.temperature, body.top_k, body.top_p)  # the schema bounds what it checks

    def _fits(self, texts: list[str], max_tokens: int) -> None:
        """Before tokenizing: a prompt whose characters need more tokens than the context holds is refused."""
        chars = sum(len(t) for t in texts)
        if self.limits.context and self.chars_per_token:
            least = -(-chars // self.chars_per_token)
            if least + max_tokens > self.limits.context:
                raise self._too_long(f"the prompt has at least {least} tokens ({chars} characters)", max_tokens)

    def _too_long(self, prompt: str, max_tokens: int) -> ApiError:
        return ApiError(
            400,
            f"{prompt} and max_tokens is {max_tokens}: together more than the target's context of "
            f"{self.limits.context}; shorten the prompt or lower max_tokens",
            code="context_length_exceeded",
            param="messages",
        )


def parse(raw: bytes, schema: type[ChatRequest] | type[CompletionRequest]):
    """The JSON body (whatever its content type says: `curl -d` sends no JSON type) checked against `schema`."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the JSON body nests {depth} levels deep; at most {MAX_JSON_DEPTH}", code="invalid_json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {first_line(e)}", code="invalid_json") from None
    except ValueError:  # the one other: an integer over Python's digit limit, in any field
        digits = sys.get_int_max_str_digits()
        message = (
            f"the JSON body has an integer of more than {digits} digits; no field takes one: send a shorter number"
        )
        raise ApiError(400, message, code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    _check_unicode(data, "")
    unsupported = refused(data)
    if unsupported:
        raise ApiError(
            400,
            f"{', '.join(unsupported)}: not supported by this server (it would ignore them); drop them or send "
            "their neutral value (false, 0, 1, null, empty)",
            code="unsupported_field",
            param=unsupported[0],
        )
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where or 'body'}: {first['msg']}", code="invalid_request", param=where or None) from None


def json_depth(raw: bytes) -> int:
    """The deepest nesting of `[` and `{` outside strings, in C-speed passes (a regex and a cumulative sum)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, delete=_NOT_BRACKETS)
    if not brackets:
        return 0
    codes = torch.frombuffer(bytearray(brackets), dtype=torch.uint8)
    steps = torch.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(steps.cumsum(0).max())


def _check_unicode(value, where: str) -> None:
    """JSON may escape a lone surrogate (`"\\ud800"`), which no tokenizer can encode: a 400, not a crash."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            where = shown(where)  # a path of the client's keys
            raise ApiError(
                400, f"{where or 'body'}: not valid Unicode (a lone surrogate)", param=where or None
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}.{i}")


def _tokenized(tokenize) -> list[int]:
    try:
        return list(tokenize())
    except (ValueError, TypeError, UnicodeError, TemplateError) as e:  # TemplateError: the template refuses it
        raise ApiError(400, f"the prompt cannot be tokenized: {first_line(e)}", param="messages") from None


def _render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation with the chat template, by the renderer `prompts.render` uses for one user turn."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    text = render_chat(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
