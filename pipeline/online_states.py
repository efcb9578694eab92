"""Online states (`data.states: online`): a training worker holds the target beside the drafter
and computes each batch's aux and final hidden states from its token ids right before its step.

The data stage then keeps token ids and loss masks only (5 bytes a token instead of 4,613 at
SmolLM2's size), so a round's shards stay small whatever the target; the price is one target
forward per training batch (every epoch, and the held-out evaluations).

Two forwards, one result: a Llama-like target runs the batched decoder's forward
(`BatchDecoder.capture`, actors/batch_decode.py: padded groups, the states stay on the device;
71k tok/s for SmolLM2 on an H200 feeding training batches in benchmarks/base_drafter.py), any
other the data stage's own HF capture (`HFTarget.capture`, through host memory). Both give the
states cast to bf16 as a shard stores them, so a batch trains alike online and offline
(tests/test_generate.py pins both paths against the offline shards on the tiny target).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from actors.config import TargetConfig
from eagle3.train_step import Batch


class OnlineStates:
    """The target on this worker's device, filling batches' states (HF backend only: the
    config refuses online states for SGLang and vLLM targets). `capacity`: the longest
    sequence a batch holds (`train.tokens_per_batch`: longer samples are cut to it)."""

    def __init__(
        self,
        target: dict[str, Any],
        aux_layer_ids: list[int],
        device: torch.device,
        capacity: int,
        batched: bool = True,
    ):
        from actors.batch_decode import BatchDecoder, decoder_problem
        from actors.hf_backend import HFTarget

        gpus = 1.0 if device.type == "cuda" else 0.0  # the worker's own GPU, as Ray gave it
        cfg = TargetConfig(**{**target, "num_gpus_per_actor": gpus})
        try:
            self.target = HFTarget(cfg)
            model = self.target.model
            self.decoder = None  # batched=False: the HF capture (tests pin both)
            if batched and decoder_problem(model) is None:
                eos = self.target.info().eos_token_ids
                self.decoder = BatchDecoder(model, 1, capacity, eos)  # its forward only
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"data.states: online loads target.model {cfg.model!r} beside the drafter on "
                f"each training worker's {device}, and it does not fit ({e}); set data.states: "
                "offline (the data stage captures the states into shards)"
            ) from None
        self.aux_layer_ids = list(aux_layer_ids)

    @torch.no_grad()  # plain tensors out (not inference ones): the drafter's backward keeps them
    def fill(self, batch: Batch) -> Batch:
        """`batch` (read from ids-only shards) with its aux [T, A*H] and final [T, H] states in
        bf16, on the target's device, each packed sequence causal on its own."""
        cu = batch.cu_seqlens
        seqs = [batch.input_ids[a:b].tolist() for a, b in zip(cu[:-1], cu[1:], strict=True)]
        capture = self.target.capture if self.decoder is None else self.decoder.capture
        states = capture(seqs, self.aux_layer_ids)
        return dataclasses.replace(
            batch,
            aux_hidden=torch.cat([a for a, _ in states]).to(torch.bfloat16),
            final_hidden=torch.cat([f for _, f in states]).to(torch.bfloat16),
        )
