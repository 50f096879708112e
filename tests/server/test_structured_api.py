"""Structured output through both APIs (official `openai` and `ollama` clients, real server, the
tiny random chat model): every answer to OpenAI `response_format` `json_schema` (strict,
streamed and not) and `json_object`, and to Ollama `format` (a schema, "json"), is JSON that
validates against its schema with `jsonschema`, on 20 varied schemas (nested objects, enums,
arrays, bounded numbers, anyOf, nullable, const, pattern); a constrained answer beside a free
one leaves the free one unchanged."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import ollama
import openai
import pytest


def S(**p: Any) -> dict[str, Any]:
    """An object schema of these properties, every one required, no others."""
    return {"type": "object", "properties": p, "required": list(p), "additionalProperties": False}


STR = {"type": "string", "maxLength": 12}
SCHEMAS = [
    S(name=STR),
    S(age={"type": "integer", "minimum": 0, "maximum": 150}),
    S(ok={"type": "boolean"}),
    S(color={"enum": ["red", "green", "blue"]}),
    S(score={"type": "number", "minimum": 0, "maximum": 1}),
    S(tags={"type": "array", "items": STR, "maxItems": 3}),
    S(ids={"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99}, "minItems": 1, "maxItems": 4}),
    S(person=S(name=STR, age={"type": "integer", "minimum": 0, "maximum": 120})),
    S(point=S(x={"type": "integer", "minimum": -10, "maximum": 10}, y={"type": "integer", "minimum": -10, "maximum": 10})),
    S(items={"type": "array", "items": S(sku=STR, qty={"type": "integer", "minimum": 1, "maximum": 9}), "maxItems": 2}),
    S(status={"enum": ["open", "closed"]}, priority={"type": "integer", "minimum": 1, "maximum": 5}),
    S(value={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}),
    S(maybe={"type": ["string", "null"], "maxLength": 8}),
    S(const={"const": "fixed"}),
    S(matrix={"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}, "maxItems": 2}),
    S(temperature={"type": "number", "minimum": -50, "maximum": 50}, unit={"enum": ["C", "F"]}),
    S(title=STR, done={"type": "boolean"}, votes={"type": "integer", "minimum": 0, "maximum": 1000}),
    S(meta=S(version={"type": "integer", "minimum": 1, "maximum": 3}, flags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3})),
    S(letter={"type": "string", "pattern": "^[a-z]{1,3}$"}),
    S(code={"type": "string", "minLength": 2, "maxLength": 4}, count={"type": "integer", "minimum": 0, "maximum": 3}),
]

MESSAGES = [{"role": "user", "content": "Fill in the form."}]


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "form", "schema": schema, "strict": True}}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_openai_json_schema_validates(oai: openai.OpenAI, model_name: str, index: int) -> None:
    schema = SCHEMAS[index]
    kw: dict[str, Any] = dict(model=model_name, messages=MESSAGES, max_tokens=300, temperature=0,
                              response_format=_format(schema))
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       oai.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content


def test_openai_json_object_and_sampling(oai: openai.OpenAI, model_name: str) -> None:
    """Any JSON object (a random model's free-form keys run on: the answer is an object's
    start, whole where it stops), and sampled answers to a bounded schema."""
    r = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=40,
                                    temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith('{"')
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    for seed in range(3):
        r = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=300,
                                        temperature=1.0, seed=seed,
                                        response_format=_format(SCHEMAS[16]))
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[16])


def test_ollama_format_schema_and_json(base_url: str, model_name: str) -> None:
    oll = ollama.Client(host=base_url)
    for schema in SCHEMAS[::4]:
        r = oll.chat(model=model_name, messages=MESSAGES, format=schema,
                     options={"temperature": 0, "num_predict": 300})
        jsonschema.validate(json.loads(r.message.content), schema)
        g = oll.generate(model=model_name, prompt="Fill in the form.", format=schema,
                         options={"temperature": 0.7, "seed": 1, "num_predict": 300})
        jsonschema.validate(json.loads(g.response), schema)
    r = oll.chat(model=model_name, messages=MESSAGES, format="json",
                 options={"temperature": 0, "num_predict": 40})
    assert r.message.content.startswith('{"')


def test_a_free_answer_beside_constrained_ones_is_unchanged(oai: openai.OpenAI,
                                                            model_name: str) -> None:
    free = dict(model=model_name, messages=[{"role": "user", "content": "Say something."}],
                max_tokens=24, temperature=0)
    alone = oai.chat.completions.create(**free).choices[0].message.content
    with ThreadPoolExecutor(5) as pool:
        constrained = [pool.submit(oai.chat.completions.create, model=model_name,
                                   messages=MESSAGES, max_tokens=300, temperature=0,
                                   response_format=_format(s)) for s in SCHEMAS[:4]]
        mixed = pool.submit(oai.chat.completions.create, **free)
        for f, s in zip(constrained, SCHEMAS[:4], strict=True):
            jsonschema.validate(json.loads(f.result().choices[0].message.content), s)
        assert mixed.result().choices[0].message.content == alone
