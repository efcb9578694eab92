"""Online states (`data.states: online`): a training worker holds the target beside the drafter
and computes each batch's aux and final hidden states from its token ids right before its step.

The data stage then keeps token ids and loss masks only (5 bytes a token instead of 4,613 at
SmolLM2's size), so a round's shards stay small whatever the target; the price is one target
forward per training batch (every epoch, and the held-out evaluations). The states are those the
data stage's forward capture writes (`HFTarget.capture`: the same hooks, layers and bf16 cast),
so a batch trains alike either way (tests/test_generate.py pins online against offline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from actors.config import TargetConfig
from eagle3.train_step import Batch


class OnlineStates:
    """The target on this worker's device, filling batches' states (HF backend only: the
    config refuses online states for SGLang and vLLM targets)."""

    def __init__(self, target: dict[str, Any], aux_layer_ids: list[int], device: torch.device):
        from actors.hf_backend import HFTarget

        gpus = 1.0 if device.type == "cuda" else 0.0  # the worker's own GPU, as Ray gave it
        cfg = TargetConfig(**{**target, "num_gpus_per_actor": gpus})
        try:
            self.target = HFTarget(cfg)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"data.states: online loads target.model {cfg.model!r} beside the drafter on "
                f"each training worker's {device}, and it does not fit ({e}); set data.states: "
                "offline (the data stage captures the states into shards)"
            ) from None
        self.aux_layer_ids = list(aux_layer_ids)

    def fill(self, batch: Batch) -> Batch:
        """`batch` (read from ids-only shards) with its aux [T, A*H] and final [T, H] states,
        bf16 on the CPU like a shard's, each packed sequence captured on its own."""
        cu = batch.cu_seqlens
        seqs = [batch.input_ids[a:b].tolist() for a, b in zip(cu[:-1], cu[1:], strict=True)]
        states = self.target.capture(seqs, self.aux_layer_ids)
        return dataclasses.replace(
            batch,
            aux_hidden=torch.cat([a for a, _ in states]),
            final_hidden=torch.cat([f for _, f in states]),
        )
