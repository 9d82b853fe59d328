"""The OpenAI request bodies the server accepts, validated: one :class:`BadRequest` naming the
reason (and the parameter) for anything else."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3.conversations import TEXT_PART_SEPARATOR


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # int64, as vLLM's
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

class _TextPart(BaseModel):
    type: Literal["text"]
    text: str

class _Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (checked with the conversation)
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None

    @model_validator(mode="after")
    def _content(self) -> _Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else TEXT_PART_SEPARATOR.join(p.text for p in self.content)

class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None  # function schemas, rendered as the chat template takes them

class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False

def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes of a request body -> the validated request, or :class:`BadRequest` naming the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {err.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadRequest(f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") \
            from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(x) for x in first["loc"])
        raise BadRequest(f"{param}: {first['msg']}" if param else first["msg"], param=param or None) from None
