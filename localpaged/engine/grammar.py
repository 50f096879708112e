"""Constrained decoding: a request's output held to a JSON schema (or to any JSON object) by a
token mask per step, compiled and tracked by `xgrammar` (its grammar compiler and matcher; see
benchmarks/grammar_masks.py for why xgrammar and not llguidance).

A `GrammarSpec` travels in the request's `SamplingParams`; the engine compiles it when the
request is added (a bad schema is a ValueError then, nothing scheduled), the runner keeps one
matcher per request, fills the masks of a step's constrained rows while the forward pass runs,
applies them to the logits and feeds each sampled token back. JSON is written compactly (no
free whitespace between tokens), so a small or random model cannot run on in blank space.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must be: `json` (any JSON object) or `json_schema` (the JSON
    text of a schema), between the literal texts `prefix` and `suffix` (a tool call's tags)."""

    kind: str
    schema: str | None = None
    prefix: str = ""
    suffix: str = ""

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, prefix: str = "",
                    suffix: str = "") -> GrammarSpec:
        """The schema as given (its property order is the output's)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema),
                   prefix, suffix)


class GrammarBackend:
    """The model's tokenizer as xgrammar sees it, a compiler and a cache of compiled
    grammars (one per spec)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self.compiled: dict[GrammarSpec, Any] = {}

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached); ValueError naming the problem if the
        schema is not one."""
        if spec not in self.compiled:
            if spec.kind not in ("json", "json_schema"):
                raise ValueError(f"grammar kind {spec.kind!r} is not supported (json, json_schema)")
            schema = spec.schema if spec.kind == "json_schema" else '{"type": "object"}'
            try:
                json.loads(schema or "")
                if spec.prefix or spec.suffix:  # literal text around the JSON
                    g = self.xgr.Grammar
                    parts = [g.from_json_schema(schema, any_whitespace=False, strict_mode=True)]
                    if spec.prefix:
                        parts.insert(0, g.from_ebnf(f"root ::= {json.dumps(spec.prefix)}"))
                    if spec.suffix:
                        parts.append(g.from_ebnf(f"root ::= {json.dumps(spec.suffix)}"))
                    self.compiled[spec] = self.compiler.compile_grammar(g.concat(*parts))
                else:
                    self.compiled[spec] = self.compiler.compile_json_schema(
                        schema, any_whitespace=False, strict_mode=True)
            except Exception as exc:  # xgrammar raises RuntimeError / ValueError variously
                why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())  # its log prefix
                raise ValueError(f"the JSON schema is not usable: {why}") from None
        return self.compiled[spec]

    def matcher(self, spec: GrammarSpec) -> Any:
        return self.xgr.GrammarMatcher(self.compile(spec))

    def fill_masks(self, rows: int, matchers: dict[int, Any]) -> torch.Tensor:
        """The step's token bitmask (int32 words, xgrammar's layout) for `rows` logits rows:
        row i as matchers[i] allows, every token in the rows without a matcher."""
        mask = self.xgr.allocate_token_bitmask(rows, self.info.vocab_size)
        for i, m in matchers.items():
            m.fill_next_token_bitmask(mask, i)
        return mask

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Mask `logits` by `mask` in place (disallowed tokens to -inf)."""
        self.xgr.apply_token_bitmask_inplace(logits, mask)
