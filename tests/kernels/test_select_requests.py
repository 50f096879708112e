"""`select_requests`: a subset of a step's requests as a batch of their own, against the same
requests' metadata built from scratch and against the whole batch's attention; `token_rows`:
each query token a decode row of its own, against the causal attention of the chunks."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels.attention import (
    AttentionMetadata,
    paged_attention_torch,
    select_requests,
    token_rows,
)
from localpaged.kernels.testing import make_paged_batch

BS = 4
# Decode rows (one query token) and prompt chunks (with and without a cached prefix), mixed.
Q_LENS = [1, 7, 1, 12, 3]
SEQ_LENS = [17, 30, 1, 12, 9]


def _from_scratch(full: AttentionMetadata, requests: list[int]) -> AttentionMetadata:
    """The metadata of `requests` built directly, request by request, from plain lists."""
    qsl = full.query_start_loc.tolist()
    slots = full.slot_mapping.tolist()
    tables = full.block_tables.tolist()
    lens = full.seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in requests]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor([s for i in requests for s in slots[qsl[i]:qsl[i + 1]]]),
        block_tables=torch.tensor([tables[i] for i in requests], dtype=torch.int32),
        seq_lens=torch.tensor([lens[i] for i in requests], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(lens[i] for i in requests))


@pytest.mark.parametrize("requests", [[0, 2], [1, 3, 4], [3, 0], [4], [0, 1, 2, 3, 4]],
                         ids=["decodes", "chunks", "reordered", "one", "all"])
def test_sub_batch_metadata_and_attention(requests: list[int]) -> None:
    query, k_cache, v_cache, full = make_paged_batch(Q_LENS, SEQ_LENS, 4, 2, 16, BS, seed=3)
    sub, rows = select_requests(full, requests)
    want = _from_scratch(full, requests)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        got, ref = getattr(sub, name), getattr(want, name)
        assert got.dtype == getattr(full, name).dtype, name
        assert torch.equal(got.long(), ref.long()), name
    assert (sub.max_query_len, sub.max_seq_len) == (want.max_query_len, want.max_seq_len)
    assert sub.is_decode_only == all(Q_LENS[i] == 1 for i in requests)
    # The rows are where the requests' query tokens sit in the whole batch.
    starts = [0, *torch.tensor(Q_LENS).cumsum(0).tolist()]
    assert rows.tolist() == [t for i in requests for t in range(starts[i], starts[i + 1])]
    # Attention of the sub-batch: the whole batch's rows of those requests.
    whole = paged_attention_torch(query, k_cache, v_cache, full, 0.25)
    alone = paged_attention_torch(query[rows], k_cache, v_cache, sub, 0.25)
    torch.testing.assert_close(alone, whole[rows], atol=1e-5, rtol=1e-5)


def test_token_rows_attend_as_the_chunks_do() -> None:
    """Each query token as a decode row (the native plan's view of a prompt chunk): a context
    ending at its own position, its request's table and slot; attention equal to the
    chunks' causal attention."""
    query, k_cache, v_cache, full = make_paged_batch(Q_LENS, SEQ_LENS, 4, 2, 16, BS, seed=5)
    rows = token_rows(full)
    n = sum(Q_LENS)
    assert rows.is_decode_only and rows.num_seqs == n
    assert rows.seq_lens.dtype == full.seq_lens.dtype
    want_lens = [s - (q - 1 - j) for q, s in zip(Q_LENS, SEQ_LENS) for j in range(q)]
    assert rows.seq_lens.tolist() == want_lens
    owners = [i for i, q in enumerate(Q_LENS) for _ in range(q)]
    assert torch.equal(rows.block_tables, full.block_tables[owners])
    assert torch.equal(rows.slot_mapping, full.slot_mapping)
    assert rows.query_start_loc.tolist() == list(range(n + 1))
    whole = paged_attention_torch(query, k_cache, v_cache, full, 0.25)
    one_by_one = paged_attention_torch(query, k_cache, v_cache, rows, 0.25)
    torch.testing.assert_close(one_by_one, whole, atol=1e-5, rtol=1e-5)
