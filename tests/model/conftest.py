"""Helpers for the model tests: hand-built attention metadata and HF reference logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from localpaged.kernels import AttentionMetadata

# One sequence's part of a step: (block_table, num_cached_tokens, num_new_tokens).
SeqStep = tuple[list[int], int, int]


def make_step(seqs: list[SeqStep], block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and AttentionMetadata for a flat batch of the given sequences."""
    positions, slots, seq_lens, qsl = [], [], [], [0]
    for table, cached, new in seqs:
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        seq_lens.append(cached + new)
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t, _, _ in seqs)
    tables = [t + [0] * (width - len(t)) for t, _, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(n for _, _, n in seqs),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), meta


def to_4bit(model: torch.nn.Module) -> None:
    """Replace every projection of every layer with a 4-bit (RTN, group 32) QuantLinear."""
    from localpaged.quant.awq import awq_quantize
    from localpaged.quant.layout import from_codes
    from localpaged.quant.linear import QuantLinear

    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                lin = getattr(parent, name)
                q = awq_quantize(lin.weight.float(), 32)
                # Scales and offsets in float16, as a GGUF Q4_1 file holds them: a float32
                # model takes the own kernel only for weights it holds exactly.
                s = q.scales.float().half().float()
                b = (-q.zeros.float() * s).half().float()
                w = from_codes(q.codes, s, -b / s, 32)
                setattr(parent, name, QuantLinear.from_int4(w, lin.bias, model.dtype, "cpu"))


@pytest.fixture(name="to_4bit", scope="session")
def to_4bit_fixture() -> Callable[[torch.nn.Module], None]:
    """`to_4bit` as a fixture (test modules do not import each other)."""
    return to_4bit


@pytest.fixture(scope="session")
def step_builder() -> Callable[[list[SeqStep], int], tuple[torch.Tensor, AttentionMetadata]]:
    return make_step


@pytest.fixture(scope="session")
def hf_logits() -> Callable[[Path, list[int]], torch.Tensor]:
    """Full-sequence float32 logits [L, vocab] of the HF model in `folder` (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    models: dict[Path, torch.nn.Module] = {}

    def run(folder: Path, ids: list[int]) -> torch.Tensor:
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[folder](torch.tensor([ids])).logits[0].float()

    return run


# -- small real tokenizers (trained here in well under a second) ----------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris!",
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n",
    "Hello, how are you today? I am fine, thank you. Tell me a joke about cats and dogs.",
    "Café crème, naïve façade, déjà vu. 中文分词测试。 Emoji: 🙂🚀✨ — “quotes” and ‘more’.",
    "1 + 1 = 2; 3 * 4 = 12; for i in range(10): print(i)  # numbers and code",
    "[INST] What is 2 + 2? [/INST] It is 4. ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz"
    " 0123456789 !?.,;:'\"()[]{}<>/\\|-_=+*&^%$#@~`\n\t",
] * 4

QWEN_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def _byte_level(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=450, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _metaspace_with_bos():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([c for c in CORPUS if c.isascii()], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def make_hf_tokenizer(kind: str):
    """"qwen": ChatML template + <|fim_*|> tokens; "starcoder": no template, <fim_*> tokens;
    "mistral": SentencePiece-style spaces, adds BOS, [INST] template with the BOS in it."""
    from transformers import PreTrainedTokenizerFast

    if kind == "qwen":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                    "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
        return PreTrainedTokenizerFast(tokenizer_object=_byte_level(specials),
                                       eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       chat_template=QWEN_TEMPLATE)
    if kind == "starcoder":
        specials = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>"]
        return PreTrainedTokenizerFast(tokenizer_object=_byte_level(specials),
                                       eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    if kind == "mistral":
        return PreTrainedTokenizerFast(tokenizer_object=_metaspace_with_bos(), bos_token="<s>",
                                       eos_token="</s>", unk_token="<unk>",
                                       chat_template=MISTRAL_TEMPLATE)
    raise ValueError(kind)


@pytest.fixture(scope="session")
def hf_tokenizers() -> dict[str, object]:
    return {k: make_hf_tokenizer(k) for k in ("qwen", "starcoder", "mistral")}
