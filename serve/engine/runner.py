"""The interface both target runners share (the eager `TargetRunner` and the static, CUDA-graph
`StaticTargetRunner`): the engine loop drives either through these methods only."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from eagle3.fit import resolve_capture_layers


class Runner(Protocol):
    """A target with a KV cache that the engine extends by verify passes and trims by acceptance.

    Shapes: B rows (the static runner: 1), q new entries per forward, L prompt tokens; aux states
    are the drafter's three target layers concatenated (3·Ht wide)."""

    valid: Tensor  # [B, S] cache slots each row attends to

    @property
    def num_layers(self) -> int: ...

    def set_aux_layers(self, ids: list[int]) -> None:
        """Capture the outputs of these decoder layers (SGLang ids) on `aux=True` forwards."""
        ...

    def prefill(
        self, prompts: list[list[int]], aux: bool
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Fresh prompts; returns (last logits [B, V], aux [B, L, 3·Ht], ids [B, L], valid)."""
        ...

    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        new_valid: Tensor,
        logits_to_keep: int = 0,
        aux: bool = False,
        tree: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """q new entries per row (a chain, or a tree given its ancestor mask [B, q, q]); returns
        (float logits [B, q, V], aux [B, q, 3·Ht])."""
        ...

    def commit(self, keep: Tensor) -> None:
        """Keep the accepted entries of the last forward ([B, q] bool)."""
        ...

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` of the batch."""
        ...

    def release(self) -> None:
        """Drop the KV cache (end of a generate call)."""
        ...


def _check_aux_ids(ids: list[int], num_layers: int) -> None:
    """Shared by both target runners: each id names a captured layer (eagle3.fit's range; the
    count is the drafter's rule, checked with the drafter)."""
    resolve_capture_layers(ids, num_layers, field="aux layer ids")
