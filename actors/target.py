"""The Ray actor that owns the target LLM: regenerate responses, capture hidden states, write shards.

The driver sends prompt batches (plain conversations) and gets back small `BatchResult` records;
tokens, hidden states and shards never leave the actor. The model sits behind `TargetBackend`, so
an SGLang backend can replace the transformers one without touching the stage.

The actor runs two calls at a time (``max_concurrency=2``) but only one of them computes (a lock):
while one batch's shards are serialised, hashed and written, the next batch is already generating.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ray
import torch

from actors.chat import Conversation, encode_conversation, prompt_ids
from actors.hf_backend import HFTarget, load_tokenizer, resolve_aux_layer_ids
from actors.shards import Sample, ShardInfo, pack_parts, shard_name, write_batch_record, write_shard
from pipeline.config import DataConfig, TargetConfig


class TargetBackend(Protocol):
    """What the data stage needs from a target engine: HFTarget here; SGLangTarget
    (actors/sglang_backend.py) has the same properties, generate and capture."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def model_id(self) -> str: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def tokenizer_hash(self) -> str: ...

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[int]]: ...

    def capture(
        self, sequences: list[list[int]], layer_ids: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def make_backend(target: TargetConfig, num_threads: int | None = None) -> TargetBackend:
    if target.backend == "hf":
        return HFTarget(target, num_threads=num_threads)
    raise NotImplementedError(
        f"target.backend={target.backend!r}: not available in the data stage yet; use target.backend=hf"
    )


@dataclass(frozen=True)
class BatchResult:
    """What one processed prompt batch sends back to the driver (no tensors)."""

    batch_index: int
    shards: tuple[ShardInfo, ...]
    num_prompts: int
    skipped_prompts: int  # prompts longer than data.max_length
    gen_tokens: int
    gen_seconds: float
    capture_tokens: int
    capture_seconds: float
    write_seconds: float


class TargetWorker:
    """Owns one target replica. Plain class (testable without Ray); `TargetActor` is its actor."""

    def __init__(self, target: TargetConfig, data: DataConfig, num_threads: int | None = None):
        os.environ.update(target.env)
        self.data = data
        self.backend = make_backend(target, num_threads)
        # chat templating happens here, so a backend without a tokenizer of its own works too
        self.tokenizer = getattr(self.backend, "tokenizer", None) or load_tokenizer(target)
        self.aux_layer_ids = resolve_aux_layer_ids(target.aux_layer_ids, self.backend.num_layers)
        self._compute = threading.Lock()

    def info(self) -> dict[str, Any]:
        """Target identity for the manifest, plus the resolved aux layer ids."""
        b = self.backend
        target = {
            "model": b.model_id,
            "revision": b.revision,
            "num_layers": b.num_layers,
            "hidden_size": b.hidden_size,
            "vocab_size": b.vocab_size,
            "tokenizer_hash": b.tokenizer_hash,
        }
        return {"target": target, "aux_layer_ids": list(self.aux_layer_ids)}

    def prompt_lengths(self, prompts: list[Conversation]) -> list[int]:
        """Templated token counts (for the storage estimate)."""
        return [len(prompt_ids(self.tokenizer, c)) for c in prompts]

    def process(
        self, batch: list[Conversation], out_dir: str, batch_index: int, batch_key: str
    ) -> BatchResult:
        """Generate responses for one prompt batch, capture hidden states of prompt + response, and
        write the batch's shards and its sidecar into ``out_dir``.

        Loss mask: the response (EOS included) plus earlier assistant turns of the prompt."""
        d = self.data
        with self._compute:
            encoded = [self._encode(c) for c in batch]
            encoded = [e for e in encoded if len(e[0]) < d.max_length]  # room for a response
            t0 = time.perf_counter()
            prompts = [ids for ids, _ in encoded]
            seed = d.seed + batch_index
            new = self.backend.generate(prompts, d.max_new_tokens, d.temperature, seed)
            t1 = time.perf_counter()
            seqs = [(p + n)[: d.max_length] for p, n in zip(prompts, new, strict=True)]
            masks = [
                (m + [1] * len(n))[: d.max_length] for (_, m), n in zip(encoded, new, strict=True)
            ]
            states = self.backend.capture(seqs, self.aux_layer_ids)
            t2 = time.perf_counter()
        # outside the lock: the next batch computes while this one is serialised and hashed
        samples = [Sample(s, m, a, f) for s, m, (a, f) in zip(seqs, masks, states, strict=True)]
        meta = {"batch_key": batch_key, "aux_layer_ids": ",".join(map(str, self.aux_layer_ids))}
        out = Path(out_dir)
        parts = pack_parts(samples, d.shard_max_bytes)
        shards = [
            write_shard(out / shard_name(batch_index, i), g, meta) for i, g in enumerate(parts)
        ]
        write_batch_record(out, batch_index, batch_key, shards, self.info())
        return BatchResult(
            batch_index=batch_index,
            shards=tuple(shards),
            num_prompts=len(batch),
            skipped_prompts=len(batch) - len(encoded),
            gen_tokens=sum(len(n) for n in new),
            gen_seconds=t1 - t0,
            capture_tokens=sum(len(s) for s in seqs),
            capture_seconds=t2 - t1,
            write_seconds=time.perf_counter() - t2,
        )

    def _encode(self, conv: Conversation) -> tuple[list[int], list[int]]:
        """Prompt ids (ending with the assistant header) and their mask, untruncated."""
        return encode_conversation(self.tokenizer, conv, 1 << 30, add_generation_prompt=True)


TargetActor = ray.remote(TargetWorker)
"""`TargetWorker` as a Ray actor; create it with
``TargetActor.options(num_cpus=..., num_gpus=target.num_gpus_per_actor, max_concurrency=2)``."""
