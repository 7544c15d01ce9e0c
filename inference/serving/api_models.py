"""What the API accepts and answers, as pydantic models: the request bodies the app validates against, and the
response shapes its OpenAPI schema (`/openapi.json`) publishes, so a client (or a fuzzer) reads from the schema
exactly what the server takes.

Fields OpenAI's API has and this server does not honour are refused with a 400 that names them (`refused`),
unless they hold their neutral value (`logprobs: false`, `n: 1`, a penalty of 0, ...), which some clients
send by default: the schema allows only that value. Other unknown fields are ignored, as OpenAI's API does.
Scalar fields are strict: `seed: true` or `stream: "yes"` are 400s, not 1 and True.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes (`pipeline.generator_seeds` keeps it there)
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256  # the text stream checks every prefix of a stop string at each cycle
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# Each refused field and the values that mean "not used" (accepted and ignored); anything else is a 400.
NEUTRAL: dict[str, tuple] = {
    "logprobs": (None, False, 0),  # chat: a bool; completions: an int
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


def refused(data: dict) -> list[str]:
    """The refused fields `data` sets to something other than their neutral value, in the order sent. A value is
    neutral when it equals one and has its type: `false` is not `0`, nor `true` `1` (float neutrals are listed)."""
    return [k for k, v in data.items() if k in NEUTRAL and not any(type(v) is type(n) and v == n for n in NEUTRAL[k])]


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
    include_usage: bool = Field(False, strict=True)  # a last chunk with no choices and the usage, as OpenAI's


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class _Sampled(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    stream: bool = Field(False, strict=True)
    max_tokens: int | None = Field(None, strict=True)
    max_completion_tokens: int | None = Field(None, strict=True)
    temperature: float = Field(1.0, ge=0.0, strict=True)  # below GREEDY_TEMPERATURE: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)  # below GREEDY_TOP_P: greedy
    top_k: int = Field(0, ge=0, le=2**31 - 1, strict=True)  # an extension of OpenAI's API; 0 keeps every token
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1], strict=True)
    stop: StopText | list[StopText] | None = Field(None, max_length=MAX_STOP_STRINGS)
    n: Literal[1] = 1
    stream_options: StreamOptions | None = None
    # Refused unless neutral (`NEUTRAL`): declared so that the schema says which value is accepted.
    top_logprobs: Literal[0] | None = None
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    frequency_penalty: Literal[0] | None = None
    presence_penalty: Literal[0] | None = None
    repetition_penalty: Literal[1] | None = None
    logit_bias: dict[str, Any] | None = Field(None, max_length=0)
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none"] | None = None
    functions: list[Any] | None = Field(None, max_length=0)
    function_call: Literal["none"] | None = None
    response_format: TextFormat | None = None
    suffix: Literal[""] | None = None
    audio: None = None
    modalities: list[Literal["text"]] | None = Field(None, min_length=1, max_length=1)
    prediction: None = None


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    logprobs: Literal[False] | None = None


class CompletionRequest(_Sampled):
    prompt: str = Field(min_length=1)
    logprobs: Literal[0] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok"]
    ready: bool
    queue_depth: int


class Readiness(BaseModel):
    status: Literal["ready", "starting"]
    queue_depth: int
