"""One step on the model: flatten the scheduled chunks into a batch, run the forward pass,
sample. Owns the KV cache tensors (the block pool only hands out their indices)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from localpaged.engine.kv_cache import KVCacheManager
from localpaged.engine.request import Logprob
from localpaged.engine.sampler import SamplingRow, make_generator, sample
from localpaged.engine.scheduler import SchedulerOutput
from localpaged.kernels import AttentionMetadata


class ModelRunner:
    """Runs `model` (see localpaged.model.llama) over flat batches."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, device: torch.device,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = model.allocate_kv_caches(num_blocks, block_size, kv_dtype, device)
        self.generators: dict[str, torch.Generator] = {}
        self.grammar: Any = None  # a GrammarBackend, set by the engine for constrained requests
        self.matchers: dict[str, Any] = {}  # request id -> its grammar matcher
        self._masker: ThreadPoolExecutor | None = None

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.matchers.pop(request_id, None)

    def _matcher(self, request: Any) -> Any:
        m = self.matchers.get(request.request_id)
        if m is None:
            m = self.matchers[request.request_id] = self.grammar.matcher(request.params.grammar)
            for token in request.output_token_ids:  # a preempted request resumes its state
                m.accept_token(token)
        return m

    def _start_masks(self, samplers: list[Any]) -> Future | None:
        """The bitmask of the step's constrained rows, computed in a thread while the forward
        pass runs (None when no row is constrained)."""
        rows = {i: self._matcher(r) for i, r in enumerate(samplers) if r.params.grammar is not None}
        if not rows:
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="localpaged-grammar")
        return self._masker.submit(self.grammar.fill_masks, len(samplers), rows)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = self.generators[request_id] = make_generator(seed)
        return g

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager
                ) -> tuple[dict[str, int], dict[str, Logprob], dict[str, list[float]]]:
        """Compute the scheduled chunks; sample for the requests whose chunk ends at their last
        token. Returns {request_id: token} and {request_id: logprob} for those, and for the
        embedding requests among them {request_id: normalized last hidden state}."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers = []
        embed_rows: list[int] = []
        embedders: list[str] = []
        for s in out.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            blocks = kv.block_ids(r.request_id)
            input_ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start + r.rope_offset, end + r.rope_offset))  # rotary rows
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(blocks)
            if s.samples and r.params.embed:
                embed_rows.append(query_start[-1] - 1)
                embedders.append(r.request_id)
            elif s.samples:
                sample_rows.append(query_start[-1] - 1)
                samplers.append(s.request)
        width = max(len(t) for t in tables)
        dev = self.device
        masks = self._start_masks(samplers)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        embeddings: dict[str, list[float]] = {}
        if embed_rows:
            last = hidden[torch.tensor(embed_rows, device=dev)].float()
            vectors = torch.nn.functional.normalize(last, dim=-1).cpu()
            embeddings = dict(zip(embedders, vectors.tolist()))
        if not sample_rows:
            return {}, {}, embeddings
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)]).float().cpu()
        if masks is not None:
            self.grammar.apply(logits, masks.result())
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids,
                        None if r.params.greedy else self._generator(r.request_id, r.params.seed))
            for r in samplers
        ]
        tokens, logprobs = sample(logits, rows)
        ids = [r.request_id for r in samplers]
        for r, token in zip(samplers, tokens):
            if r.params.grammar is not None:
                self.matchers[r.request_id].accept_token(token)
        return dict(zip(ids, tokens)), (dict(zip(ids, logprobs)) if logprobs else {}), embeddings
