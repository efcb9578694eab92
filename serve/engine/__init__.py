"""Embedded speculative-decoding engine: an HF causal LM target and an EAGLE-3 drafter in one
process, one module per role (as sglang's `srt/speculative/` and vLLM's `v1/spec_decode/`):

- `loop`: `SpecEngine`, the scheduling loop (prefill, draft, verify, accept, commit) and the
  plain decoding baseline; the cycle itself is described there;
- `runner`: `Runner`, the interface both target runners share;
- `eager`: `TargetRunner`, batched, any HF causal LM; `static`: `StaticTargetRunner`, batch 1 on
  a GPU with a preallocated cache and CUDA graphs; `kernels`: its Triton attention;
- `linear`: the few-row CPU matmul; `drafting`: the EAGLE-3 draft source (chains and trees);
  `static_draft`: the same drafter at static shapes, captured as CUDA graphs on a GPU;
  `acceptance`: greedy and rejection-sampling acceptance; `requests`: request records;
- `loading`: target and drafter loading, the drafter-fits-target check (eagle3.fit).

`from serve.engine import X` keeps working for every name below.
"""

from serve.engine.acceptance import (
    greedy_accept,
    rejection_accept,
    sample_token,
    tree_greedy_accept,
)
from serve.engine.drafting import DraftSource, DraftTree, EagleDraft, tree_ancestors, tree_problem
from serve.engine.eager import TargetRunner, decoder_layers
from serve.engine.kernels import ATTN_BLOCK_N, ATTN_SPLITS, triton_attention_ok
from serve.engine.linear import SMALL_ROWS, small_rows_linear, use_small_rows_linear
from serve.engine.loading import check_drafter_for_target, load_eagle, load_target, random_drafter
from serve.engine.loop import SpecEngine, eos_ids
from serve.engine.requests import Generation, GenParams, RequestStats, TokenCallback
from serve.engine.runner import Runner, _check_aux_ids
from serve.engine.static import StaticTargetRunner, static_runner_problem
from serve.engine.static_draft import StaticEagleDraft, serving_drafter_compile

__all__ = [
    "ATTN_BLOCK_N",
    "ATTN_SPLITS",
    "SMALL_ROWS",
    "DraftSource",
    "DraftTree",
    "EagleDraft",
    "GenParams",
    "Generation",
    "RequestStats",
    "Runner",
    "SpecEngine",
    "StaticEagleDraft",
    "StaticTargetRunner",
    "TargetRunner",
    "TokenCallback",
    "_check_aux_ids",
    "check_drafter_for_target",
    "decoder_layers",
    "eos_ids",
    "greedy_accept",
    "load_eagle",
    "load_target",
    "random_drafter",
    "rejection_accept",
    "sample_token",
    "serving_drafter_compile",
    "small_rows_linear",
    "static_runner_problem",
    "tree_ancestors",
    "tree_greedy_accept",
    "tree_problem",
    "triton_attention_ok",
    "use_small_rows_linear",
]
