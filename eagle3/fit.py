"""What fits a target, written once: the aux-layer-id rule and the drafter-fits-target check.

Preflight (against the target's config.json, before Ray starts), the data stage (both target
backends), training, the engine, the SGLang deployment and the compatibility report call these,
so a drafter or an id list that one of them accepts is accepted by all of them.

Aux layer ids follow SGLang's `eagle_aux_hidden_state_layer_ids`: id k is the output of decoder
layer k (0-based) = HF `hidden_states[k+1]`, which SGLang captures at the input of layer k+1. So
k must lie in 0..N-2 for an N-layer target (the last layer's output is never captured; HF's
`hidden_states[N]` is after the final norm), and there are exactly three: the drafter's `fc`
fuses three target hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3.config import Eagle3Config, default_aux_layer_ids

AUX_COUNT = 3  # fc takes cat(low, mid, high): 3 x target hidden


def bad_aux_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids of `ids` that name no captured layer of a `num_layers`-layer target."""
    return [k for k in ids if not 0 <= k <= num_layers - 2]


def aux_layer_problem(ids: Sequence[int], num_layers: int | None) -> str | None:
    """Why `ids` cannot be the aux layers of a `num_layers`-layer target (one sentence), or None.
    With `num_layers` None (target not known yet) only the count is checked."""
    ids = list(ids)
    bad = bad_aux_ids(ids, num_layers) if num_layers is not None else []
    if len(ids) == AUX_COUNT and not bad:
        return None
    what = [f"{len(ids)} given" if len(ids) != AUX_COUNT else "", f"{bad} outside" if bad else ""]
    where = f"for a {num_layers}-layer target" if num_layers is not None else "for any target"
    span = f" in 0..{num_layers - 2}" if num_layers is not None else ""
    return (
        f"{ids} invalid {where}: EAGLE-3 needs {AUX_COUNT} ids (its fc fuses three target "
        f"layers), each k (output of decoder layer k, captured at the input of layer k+1){span} "
        f"({', '.join(w for w in what if w)})"
    )


def aux_layer_error(field: str, ids: Sequence[int], num_layers: int | None) -> str | None:
    """The full error for a bad id list: field, value, rule and the fix; None when it is fine."""
    problem = aux_layer_problem(ids, num_layers)
    if problem is None:
        return None
    default = default_aux_layer_ids(num_layers) if num_layers is not None else "[1, N//2-1, N-4]"
    return f"{field}: {problem}; pick ids for this target or omit it for SGLang's default {default}"


def resolve_aux_layer_ids(
    ids: Sequence[int] | None, num_layers: int, field: str = "target.aux_layer_ids"
) -> list[int]:
    """`ids`, or SGLang's default [1, N//2-1, N-4] when None; raises ValueError naming `field`,
    the bad value and the fix."""
    out = default_aux_layer_ids(num_layers) if ids is None else list(ids)
    err = aux_layer_error(field, out, num_layers)
    if err:
        raise ValueError(err)
    return out


def resolve_capture_layers(
    ids: Sequence[int] | None, num_layers: int, field: str = "target.aux_layer_ids"
) -> list[int]:
    """Layers a runner or backend captures: `ids` (SGLang's default when None), each naming a
    captured layer. Any number of layers may be captured; the three-id rule is the drafter's
    (`resolve_aux_layer_ids`, applied where the data stage and the engine pick the ids)."""
    out = default_aux_layer_ids(num_layers) if ids is None else list(ids)
    bad = bad_aux_ids(out, num_layers)
    if bad or not out:
        raise ValueError(
            f"{field}: {out} invalid for a {num_layers}-layer target: ids {bad} outside "
            f"0..{num_layers - 2} (id k is the output of decoder layer k, captured at the input "
            "of layer k+1)"
        )
    return out


@dataclass(frozen=True)
class FitCheck:
    """One property a drafter must share with its target: both sides, verdict and the fix."""

    field: str
    drafter: Any
    target: Any
    ok: bool
    fix: str


def drafter_fit(
    cfg: Eagle3Config, *, vocab_size: int, hidden_size: int, num_layers: int
) -> list[FitCheck]:
    """Every check of a drafter config against a target's vocab, width and depth. A drafter
    without ids gets SGLang's default for this target (what the servers do)."""
    ids = list(cfg.aux_layer_ids) or default_aux_layer_ids(num_layers)
    aux = aux_layer_problem(ids, num_layers)
    return [
        FitCheck(
            "vocab_size", cfg.vocab_size, vocab_size, cfg.vocab_size == vocab_size,
            f"vocab_size {cfg.vocab_size} != target vocab {vocab_size}; the drafter was built "
            "for another target (its vocab_size must be the target's)",
        ),
        FitCheck(
            "draft_vocab_size", cfg.draft_vocab_size, f"<= {vocab_size}",
            cfg.draft_vocab_size <= vocab_size,
            f"draft_vocab_size {cfg.draft_vocab_size} > target vocab {vocab_size}; the draft "
            "vocab must be a subset of the target's",
        ),
        FitCheck(
            "hidden_size", cfg.hidden_size, hidden_size, cfg.hidden_size == hidden_size,
            f"hidden_size {cfg.hidden_size} != target hidden {hidden_size}; the drafter reads the "
            "target's embedding, so build it with hidden_size = the target's",
        ),
        FitCheck(
            "target_hidden_size", cfg.target_hidden_size, hidden_size,
            cfg.target_hidden_size == hidden_size,
            f"target_hidden_size {cfg.target_hidden_size} != target hidden {hidden_size}; its fc "
            "reads another target (set target_hidden_size to the target's and retrain fc)",
        ),
        FitCheck(
            "eagle_aux_hidden_state_layer_ids", ids, f"{AUX_COUNT} in 0..{num_layers - 2}",
            aux is None, f"eagle_aux_hidden_state_layer_ids: {aux}",
        ),
    ]  # fmt: skip


def drafter_fit_problems(
    cfg: Eagle3Config, *, vocab_size: int, hidden_size: int, num_layers: int, source: str = ""
) -> list[str]:
    """Every way a drafter config does not fit the target, one line each (prefixed `source: `)."""
    prefix = f"{source}: " if source else ""
    checks = drafter_fit(cfg, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers)
    return [prefix + c.fix for c in checks if not c.ok]
