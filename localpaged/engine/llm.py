"""The offline API users know from vLLM: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from localpaged.engine.client import Message
from localpaged.engine.config import EngineArgs
from localpaged.engine.engine import LLMEngine
from localpaged.engine.request import CompletionOutput, RequestOutput, SamplingParams

PromptInput = str | dict[str, Any]


class LLM:
    """Batch generation on one model: every prompt is submitted at once and continuously
    batched. `model` is a catalog name, an HF folder or a .gguf file; `engine_args` are
    EngineArgs fields (dtype, max_num_batched_tokens, max_num_seqs, block_size, kv_cache_gb,
    num_kv_blocks, enable_prefix_caching, max_model_len, device, max_step_ms).

    Nobody watches an offline batch stream, so the step-time bound is off unless
    `max_step_ms` is given: prompts are read at the whole token budget."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        engine_args.setdefault("max_step_ms", 0)
        self.engine = LLMEngine.from_args(EngineArgs(model=str(model), **engine_args))
        self.engine.finish_idle_work()  # no idle time here: the weights' move now

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is a string or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params has {len(params_list)} entries for "
                             f"{len(prompts)} prompts")
        # Validate everything first, so a bad prompt schedules nothing.
        encoded = [self._encode(p) for p in prompts]
        for ids, p in zip(encoded, params_list):
            self.engine.validate(ids, p)
        return self._run(encoded, params_list, [p if isinstance(p, str) else None for p in prompts])

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (or to each of several)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=True)}
                   for c in convs]
        return self.generate(prompts, sampling_params)

    def embed(self, prompts: PromptInput | Sequence[PromptInput]) -> list[list[float]]:
        """Each prompt's normalized last-token hidden state (a decoder embedding model's
        vector), in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = SamplingParams(max_tokens=1, embed=True)
        encoded = [self._encode(p) for p in prompts]
        for ids in encoded:
            self.engine.validate(ids, params)
        order = [self.engine.add_request(ids, params).request_id for ids in encoded]
        vectors: dict[str, list[float]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.embedding is not None:
                    vectors[out.request_id] = out.embedding
        return [vectors[rid] for rid in order]

    def _encode(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.engine.encode_prompt(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        return self.engine.encode_prompt(prompt)

    def _run(self, encoded: list[list[int]], params: list[SamplingParams],
             texts: list[str | None]) -> list[RequestOutput]:
        order, results = [], {}
        for ids, p, text in zip(encoded, params, texts):
            r = self.engine.add_request(ids, p)
            order.append(r.request_id)
            results[r.request_id] = RequestOutput(r.request_id, text, ids,
                                                  [CompletionOutput(0, "", [])], False)
        requests = {rid: self.engine.scheduler.requests[rid] for rid in order}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                res = results[out.request_id]
                comp = res.outputs[0]
                comp.text += out.new_text
                comp.token_ids.extend(out.new_token_ids)
                if out.logprobs:
                    comp.logprobs = (comp.logprobs or []) + out.logprobs
                if out.finished:
                    res.finished = True
                    comp.finish_reason = out.finish_reason
                    comp.stop_reason = requests[out.request_id].stop_reason
                    res.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in order]
