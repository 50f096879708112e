"""Embeddings for both APIs: each input through the engine as an embedding request (batched in
the same steps as the chats, its prefix served by the prefix cache like theirs), the vector
the model's normalized last-token hidden state (decoder embedding models, Qwen3-Embedding's
pooling), shortened to `dimensions` and normalized again where asked (Matryoshka)."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from typing import Any

from localpaged.server.errors import APIError
from localpaged.server.streams import ServerState

Input = str | list[int]


def as_inputs(value: Any, param: str = "input") -> list[Input]:
    """A request's input as a list of texts or token-id lists (OpenAI accepts a string, a
    list of strings, a list of ids or a list of id lists)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, int) for t in v))
            for v in value):
        return list(value)
    raise APIError(400, "input must be a string, a list of strings or of token id lists, "
                   "not empty", param=param)


async def embed(state: ServerState, inputs: list[Input], *, dimensions: int | None = None,
                truncate: bool = False, param: str = "input") -> tuple[list[list[float]], int]:
    """The vectors of `inputs` (in order) and their prompt tokens in all. An input longer than
    the context is cut to fit with `truncate`, else refused."""
    client = state.client
    if not hasattr(client, "embed"):
        raise APIError(400, "this server's engine does not compute embeddings (it forwards "
                       "to a remote one); serve the model locally", param="model")
    if dimensions is not None and dimensions < 1:
        raise APIError(400, f"dimensions={dimensions} is invalid: give an integer >= 1",
                       param="dimensions")
    limit = state.context_length()
    prompts: list[list[int]] = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            if state.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: give token ids", param=param)
            ids = state.tokenizer.encode(x, add_special_tokens=True)
        else:
            ids = list(x)
        if not ids:
            raise APIError(400, f"{param}[{i}] is empty", param=param)
        if limit and len(ids) >= limit:
            if not truncate:
                raise APIError(400, f"{param}[{i}] is {len(ids)} tokens, the context is "
                               f"{limit}: shorten it (or ask for truncation)", param=param)
            ids = ids[: limit - 1]
        prompts.append(ids)
    try:
        results = await asyncio.gather(*(client.embed(p) for p in prompts))
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc
    except RuntimeError as exc:
        raise APIError(500, f"engine error: {exc}") from exc
    vectors = [v for v, _ in results]
    if dimensions is not None:
        size = len(vectors[0])
        if dimensions > size:
            raise APIError(400, f"dimensions={dimensions} is more than the model's {size}",
                           param="dimensions")
        vectors = [_normalized(v[:dimensions]) for v in vectors]
    return vectors, sum(n for _, n in results)


def _normalized(v: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def base64_floats(v: list[float]) -> str:
    """OpenAI's `encoding_format: base64`: the float32 values, little-endian, in base64."""
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
