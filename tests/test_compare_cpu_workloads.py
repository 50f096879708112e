"""benchmarks/compare_cpu.py's workloads: the default model's token counts unchanged, scaled
ones for large models (`--model`), and llama.cpp's contexts sized to hold them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare_cpu


def counts(w: dict) -> tuple[int, ...]:
    s, c, p, d = w["single"], w["conc32"], w["prefix"], w["chat"]
    return (len(s["prompt"]), s["new"], len(c["prompts"]), len(c["prompts"][0]), c["new"],
            len(p["prefix"]), len(p["suffixes"]), p["new"], len(d["turns"]), len(d["turns"][0]),
            d["answer"])


def test_full_size_counts_are_the_documented_ones() -> None:
    assert counts(compare_cpu.workloads(False)) == (512, 128, 32, 64, 128, 1000, 16, 32, 10, 150, 32)
    assert counts(compare_cpu.workloads(True)) == (128, 32, 32, 64, 32, 250, 16, 8, 3, 150, 8)


def test_large_models_scale_token_counts_not_requests() -> None:
    assert compare_cpu.auto_scale(134_515_008) == 1.0  # SmolLM2-135M
    scale = compare_cpu.auto_scale(1_711_376_384)  # smollm2:1.7b's shape
    assert scale == 0.48 and compare_cpu.auto_scale(6_878_000_000) == 0.24
    w = compare_cpu.workloads(False, scale)
    assert counts(w) == (246, 61, 32, 31, 61, 480, 16, 15, 10, 72, 15)
    assert w["single"]["prompt"] == compare_cpu.workloads(False, scale)["single"]["prompt"]
    assert counts(compare_cpu.workloads(True, 0.01))[1] == 2  # a decode rate needs 2 tokens


def test_token_ids_fit_the_vocabulary() -> None:
    w = compare_cpu.workloads(True, 1.0, vocab=512)
    assert all(0 <= t < 512 for t in w["single"]["prompt"] + w["chat"]["turns"][0])


def test_llamacpp_contexts_hold_the_workloads() -> None:
    one, many = compare_cpu.kv_tokens(compare_cpu.workloads(False))
    assert one >= 10 * (150 + 32) and many >= 16 * (1000 + 32 + 32) and many <= 20480


def test_defaults_trailing_a_forced_variant_show_both_runs_ranges() -> None:
    def runs(decode: list[float], chat: list[float]) -> dict:
        return compare_cpu.summarize([{"decode_tok_s": d, "chat_ttft_sum_s": c}
                                      for d, c in zip(decode, chat, strict=True)])

    ours = runs([150.0, 160.0, 170.0], [1.5, 1.6, 1.7])
    overlapping = runs([155.0, 165.0, 175.0], [1.4, 1.5, 1.6])
    apart = runs([200.0, 210.0, 220.0], [1.0, 1.1, 1.2])
    faster = runs([100.0, 110.0, 120.0], [2.0, 2.1, 2.2])
    assert compare_cpu.slower_workloads(ours, faster) == []
    assert compare_cpu.slower_workloads(ours, overlapping) == [
        "single stream decode, tok/s 160.0 vs 165.0 (runs 150.0-170.0 vs 155.0-175.0: "
        "the ranges overlap)",
        "chat (d), sum of TTFTs, s 1.6 vs 1.5 (runs 1.5-1.7 vs 1.4-1.6: the ranges overlap)"]
    assert compare_cpu.slower_workloads(ours, apart) == [
        "single stream decode, tok/s 160.0 vs 210.0 (runs 150.0-170.0 vs 200.0-220.0: apart)",
        "chat (d), sum of TTFTs, s 1.6 vs 1.1 (runs 1.5-1.7 vs 1.0-1.2: apart)"]
    one_run = compare_cpu.summarize([{"decode_tok_s": 150.0}])
    assert compare_cpu.slower_workloads(one_run, compare_cpu.summarize([{"decode_tok_s": 151.0}])) == [
        "single stream decode, tok/s 150.0 vs 151.0"]


def test_each_round_starts_one_engine_later() -> None:
    names = ["localpaged", "localpaged[avx2]", "llama.cpp"]
    firsts = [compare_cpu.rotated(names, r)[0] for r in range(4)]
    assert firsts == ["localpaged", "localpaged[avx2]", "llama.cpp", "localpaged"]
    for r in range(4):  # every engine once a round, whatever the start
        assert sorted(compare_cpu.rotated(names, r)) == sorted(names)
    assert compare_cpu.rotated([], 2) == []
