"""The real SmolLM2-135M-Instruct (its GGUF converted to an HF folder by transformers):
our engine's greedy answer and logprobs equal transformers' on the same folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localpaged import LLM, SamplingParams

pytestmark = pytest.mark.smollm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# The cache as the engine keeps it by default (float16 under a float32 model on the CPU: each
# key and value rounded to 11 bits, the answer's log-probabilities a few thousandths away) and
# pinned to float32 (the same arithmetic as transformers' up to summation order).
@pytest.mark.parametrize(("kv_cache_dtype", "tolerance"), [("auto", 5e-3), ("float32", 1e-3)])
def test_greedy_answer_and_logprobs_match_transformers(smollm_hf_dir: Path, kv_cache_dtype: str,
                                                       tolerance: float) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(str(smollm_hf_dir), dtype="float32", max_num_batched_tokens=16,  # chunked prefill
              kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == (
        torch.float16 if kv_cache_dtype == "auto" else torch.float32)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24, logprobs=1))[0]
    answer = out.outputs[0]

    tok = AutoTokenizer.from_pretrained(smollm_hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm_hf_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    assert out.prompt_token_ids == ids[0].tolist()
    ref = hf.generate(ids, do_sample=False, max_new_tokens=24, output_scores=True,
                      return_dict_in_generate=True)
    ref_ids = ref.sequences[0, ids.shape[1]:].tolist()
    assert answer.token_ids == ref_ids
    assert "Paris" in answer.text
    assert answer.text.strip() == tok.decode(ref_ids, skip_special_tokens=True).strip()
    ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, ref_ids)]
    assert [lp.logprob for lp in answer.logprobs] == pytest.approx(ref_lp, abs=tolerance)


def test_stop_strings_end_the_answer_and_never_leak(smollm_hf_dir: Path) -> None:
    llm = LLM(str(smollm_hf_dir), dtype="float32")
    full = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    assert "Paris" in full
    cut = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))[0]
    assert cut.outputs[0].text == full[:full.index("Paris")]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == "Paris"
