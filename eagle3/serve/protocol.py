"""The OpenAI-compatible request bodies (pydantic) and the OpenAI error shape.

Requests are validated strictly: unknown fields are refused with 400 the way OpenAI refuses them
("Unrecognized request argument supplied"), wrong types and out-of-range sampling values give
400 too (FastAPI's default is 422; OpenAI clients expect 400). A few vLLM extensions that
benchmark clients and lm-eval send are accepted (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``chat_template_kwargs``, ``prompt_logprobs``,
``return_tokens_as_token_ids``, ...). Fields that OpenAI defines but this server cannot honour
(penalties, n > 1, tools) are accepted only with their neutral value so that a client that sends
the defaults explicitly still works. Logprob counts are checked here for sign and combination; their
upper bound is the engine's ``max_logprobs`` (the handlers check it).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1
# top_k becomes an int64 tensor in the sampler: anything larger overflowed there (a 500 that failed
# every request of the step). Values >= the vocabulary size already mean "off".
_INT64_MAX = (1 << 63) - 1
# Stop strings are searched in the text after every step and the longest one sets how much text a
# stream holds back: bound both so that one request cannot make every step slow.
_MAX_STOPS, _MAX_STOP_CHARS, _MAX_STOP_TOKEN_IDS = 64, 1024, 1024

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
PromptInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class FieldError(ValueError):
    """A model-level validation failure that names the request field it is about."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status_code: int = 400, *, param: str | None = None,
                 type_: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status_code, "invalid_request_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type_for(status_code: int) -> str:
    return _ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM name; accepted, usage is only sent at the end


def _first_bad_text(value: Any) -> bool:
    """True when ``value`` holds a string (or a dict key) that is not valid Unicode text: JSON's
    ``"\\ud800"`` escape decodes to a lone surrogate, which no tokenizer (and no UTF-8 encoder)
    accepts. Iterative, so a deeply nested body cannot exhaust the stack."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


class _Request(BaseModel):
    """Every request body: unknown fields refused, no NaN / Infinity floats (Python's JSON parser
    accepts those literals), and text that is valid Unicode in every field (400 naming the field,
    not a 500 from the tokenizer)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if _first_bad_text(key) or _first_bad_text(value):
                    name = key if isinstance(key, str) and not _first_bad_text(key) else "body"
                    raise FieldError(name, f"{name}: contains a lone UTF-16 surrogate (e.g. \\ud800); "
                                           f"text must be valid Unicode")
        return data


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=_INT64_MAX)
    n: StrictInt = Field(default=1, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=_INT64_MAX)]] | None = None
    include_stop_str_in_output: StrictBool = False
    seed: StrictInt | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: StrictStr | None = None
    # Accepted only with their neutral values (see module docstring).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _neutral_only(self) -> _SamplingFields:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0), ("min_p", 0.0)):
            value = getattr(self, name)
            if not math.isfinite(value) or value != neutral:
                raise FieldError(name, f"{name}={value} is not supported by this server (only {neutral})")
        if self.temperature is not None and not math.isfinite(self.temperature):
            raise FieldError("temperature", "temperature must be finite")
        if self.n != 1:
            raise FieldError("n", "only n=1 is supported")
        if self.logit_bias:
            raise FieldError("logit_bias", "logit_bias is not supported")
        if not self.skip_special_tokens:
            raise FieldError("skip_special_tokens", "skip_special_tokens=false is not supported")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if any(s == "" for s in stops):
                raise FieldError("stop", "stop strings must be non-empty")
            if len(stops) > _MAX_STOPS:
                raise FieldError("stop", f"at most {_MAX_STOPS} stop strings, got {len(stops)}")
            if any(len(s) > _MAX_STOP_CHARS for s in stops):
                raise FieldError("stop", f"stop strings must be at most {_MAX_STOP_CHARS} characters")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > _MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"at most {_MAX_STOP_TOKEN_IDS} stop_token_ids")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: text, list of texts, token ids or lists of token ids
    (lm-eval's ``local-completions`` sends lists of token-id lists by default)."""

    prompt: PromptInput
    # OpenAI's default for completions; 0 only with echo (the prompt's text and logprobs alone)
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = None  # N most likely tokens per token (0: the chosen token's only)
    prompt_logprobs: StrictInt | None = None  # vLLM's: logprobs of the prompt tokens, top N
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: tokens as "token_id:<id>"
    # vLLM's and SGLang's: the choice also carries prompt_token_ids and token_ids (the output's)
    return_token_ids: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = False

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) < 0:
                raise FieldError(name, f"{name} must be >= 0 (the number of most likely tokens to return), "
                                       f"got {getattr(self, name)}")
        if self.prompt_logprobs and self.stream:
            raise FieldError("prompt_logprobs", "prompt_logprobs are not available with stream=true "
                                                "(echo=true with logprobs streams the prompt's logprobs)")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens=0 needs echo=true (it returns the prompt alone)")
        if self.best_of not in (None, 1):
            raise FieldError("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per choice (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    # extra="allow": assistant tool_calls / reasoning fields from a previous turn are passed to the
    # chat template as they are (templates read what they need).
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            d["content"] = ""
        return d


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: tokens as "token_id:<id>"
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise FieldError("top_logprobs", f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.response_format is not None and self.response_format.type != "text":
            raise FieldError("response_format", f"response_format {self.response_format.type!r} is not supported")
        if self.tools:
            raise FieldError("tools", "tools are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "tool_choice is not supported by this server")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt=false")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize`` (used by lm-eval's ``tokenizer_backend=remote``)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = False
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line (and the offending parameter) from pydantic / FastAPI validation errors."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # Unions report every branch (``prompt.str``, ``prompt.list[int]``); the field name is enough.
    param = loc[0] if loc else None
    etype = err.get("type", "")
    if etype == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg', ''))}", None
    if etype == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(loc)}", param
    if etype == "missing":
        return f"missing required field: {'.'.join(loc)}", param
    if etype == "model_attributes_type" and not loc:
        return "request body must be a JSON object", None
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return str(cause), cause.param
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    where = ".".join(loc)
    return (f"{where}: {msg}" if where else msg), param
