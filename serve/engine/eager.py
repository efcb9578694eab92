"""The eager target runner: one HF causal LM over a batch, its KV cache with masked (rejected)
slots, and the aux hidden states of the drafter's layers."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from serve.engine.runner import _check_aux_ids

# ----------------------------------------------------------------------------------------------
# The target: one HF causal LM, its KV cache and the aux hidden states of three layers


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (Llama-like `model.model.layers`)."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise ValueError(
        f"{type(model).__name__}: no decoder layer list (model.layers); unsupported target"
    )


class TargetRunner:
    """Runs the target over a batch with a KV cache whose slots may hold masked (rejected) entries.

    `valid` [B, S] marks the cache slots each row attends to. Aux states come from forward hooks on
    the chosen decoder layers (SGLang id k = output of layer k), only while `capture` is set."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.layers = decoder_layers(model)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.hidden_size = int(model.get_input_embeddings().weight.shape[1])
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.aux_ids: list[int] = []
        self._hooks: list[Any] = []
        self._captured: dict[int, Tensor] = {}
        self.capture = False
        self.cache: Any = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def set_aux_layers(self, ids: list[int]) -> None:
        _check_aux_ids(ids, self.num_layers)
        if ids == self.aux_ids:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = [self.layers[k].register_forward_hook(self._hook(k)) for k in ids]
        self.aux_ids = list(ids)

    def _hook(self, k: int):
        def hook(_module, _args, output):
            if self.capture:
                self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    # -- cache bookkeeping ------------------------------------------------------------------
    def _kv_layers(self) -> list[Any]:
        return list(self.cache.layers)

    def _slice_slots(self, start: int, end: int) -> None:
        for layer in self._kv_layers():
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., start:end, :]
                layer.values = layer.values[..., start:end, :]
        self.valid = self.valid[:, start:end]

    def commit(self, keep: Tensor) -> None:
        """Mark which of the last forward's entries stay ([B, q] bool), then drop slots no row uses
        at the tail and compact when masked holes exceed the live length."""
        self.valid = torch.cat([self.valid, keep], dim=1)
        used = self.valid.any(0).nonzero()
        end = int(used.max()) + 1 if used.numel() else 0
        if end < self.valid.shape[1]:
            self._slice_slots(0, end)
        live = int(self.valid.sum(1).max())
        if (
            self.valid.shape[1] > live + live // 2 + 32
        ):  # attention over holes costs more than a gather
            self._compact(live)

    def _compact(self, live: int) -> None:
        """Gather each row's valid slots to the right (left padding); order inside a row is kept,
        and RoPE is already in the keys, so attention results do not change."""
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, -live:]  # [B, L]
        for layer in self._kv_layers():
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            B, H, _, D = layer.keys.shape
            idx = order[:, None, :, None].expand(B, H, live, D)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.valid = self.valid.gather(1, order)

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` of the batch; drop leading and trailing slots no remaining row uses."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        used = self.valid.any(0).nonzero()
        if used.numel():
            self._slice_slots(int(used.min()), int(used.max()) + 1)

    # -- forwards ---------------------------------------------------------------------------
    def _mask(
        self, new_valid: Tensor, dtype: torch.dtype, tree: Tensor | None = None
    ) -> Tensor | None:
        """Float 4-D mask [B, 1, q, S+q]: valid cache slots plus causal new entries (or `tree`
        [B, q, q]: each entry sees its ancestors and itself). None when HF's own causal mask is
        the same thing (no padding, no holes, no tree): batch-1 numerics stay those of `generate`."""
        B, q = new_valid.shape
        if tree is None and bool(self.valid.all()) and bool(new_valid.all()):
            return None
        causal = torch.ones(q, q, dtype=torch.bool).tril()[None] if tree is None else tree
        new = causal & new_valid[:, None, :]
        new = new | torch.eye(q, dtype=torch.bool)[None]  # a padding query sees itself: no NaN row
        old = self.valid[:, None, :].expand(B, q, self.valid.shape[1])
        allowed = torch.cat([old, new], dim=2)[:, None]
        zero = torch.zeros((), dtype=dtype)
        return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))

    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        new_valid: Tensor,
        logits_to_keep: int = 0,
        aux: bool = False,
        tree: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run q new entries per row (a chain, or a tree given its ancestor mask [B, q, q]);
        returns (float logits [B, q or keep, V], aux [B, q, 3·Ht])."""
        dtype = self.model.get_input_embeddings().weight.dtype
        self.capture = aux and bool(self.aux_ids)
        self._captured.clear()
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self._mask(new_valid, dtype, tree),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self.cache_kw: self.cache},
            )
        finally:
            self.capture = False
        states = (
            torch.cat([self._captured[k] for k in self.aux_ids], -1)
            if aux and self.aux_ids
            else None
        )
        self._captured.clear()
        return out.logits.float(), states

    def prefill(
        self, prompts: list[list[int]], aux: bool
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Left-padded prefill of fresh prompts; returns (last logits [B, V], aux [B, L, 3·Ht],
        padded ids [B, L], valid [B, L])."""
        from transformers import DynamicCache

        L = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        valid = torch.zeros(len(prompts), L, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, L - len(p) :] = True
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        self.valid = torch.zeros(len(prompts), 0, dtype=torch.bool)
        logits, states = self.forward(ids, positions, valid, logits_to_keep=1, aux=aux)
        self.valid = valid
        return logits[:, -1], states, ids, valid

    def release(self) -> None:
        self.cache = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
