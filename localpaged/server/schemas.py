"""Request bodies. Unknown fields are ignored (plugins pass extra keys through); wrong types
become 400s through the validation handler."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- OpenAI -------------------------------------------------------------------------------


class ContentPart(_Body):
    """One part of a multi-part message content; only `text` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # a past answer's thinking (thinking models)
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, accepted as plugins that target vLLM send them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model: str
    input: Any
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions; `suffix` asks for fill-in-the-middle."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = None


# ---- Ollama -------------------------------------------------------------------------------


class OllamaOptions(_Body):
    num_ctx: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


KeepAlive = str | float | None


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    thinking: str | None = None  # a past answer's thinking (thinking models)
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls


class OllamaChatRequest(_Body):
    """POST /api/chat."""

    model: str
    messages: list[OllamaMessage] = Field(default_factory=list)
    think: bool | None = None  # thinking models: False asks the template not to think
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None
    tools: list[Any] | None = None


class OllamaGenerateRequest(_Body):
    """POST /api/generate; `suffix` asks for fill-in-the-middle, `raw` skips the template."""

    model: str
    prompt: str | None = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None
    images: list[str] | None = None
    think: bool | None = None  # thinking models: False asks the template not to think


class OllamaEmbedRequest(_Body):
    """POST /api/embed."""

    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: KeepAlive = None
    options: OllamaOptions | None = None


class OllamaEmbeddingsRequest(_Body):
    """POST /api/embeddings (Ollama's older endpoint: one prompt, `embedding`)."""

    model: str
    prompt: str
    keep_alive: KeepAlive = None
    options: OllamaOptions | None = None


class OllamaModelRequest(_Body):
    """/api/show and /api/pull name the model as `model` (or the older `name`)."""

    model: str | None = None
    name: str | None = None
    stream: bool = True
    verbose: bool | None = None
    insecure: bool | None = None

    @property
    def model_name(self) -> str | None:
        return self.model or self.name


# ---- OpenAI response shapes (documentation: the routes build plain dicts) -----------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx under /v1."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str = Field(description='"stop", "length" or "abort"')


class ChatCompletion(BaseModel):
    """The answer of a non-streaming chat completion. With `stream: true` the answer is
    `text/event-stream` of `chat.completion.chunk` objects ending in `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str


class Completion(BaseModel):
    """The answer of a non-streaming completion (SSE of the same objects with `stream`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
