"""SpecForge 0.2 as a side-by-side anchor for benchmarks/gpu_train.py (benchmarked, never vendored).

Install on the GPU host without dependencies (`pip install --no-deps specforge==0.2.0`, or the wheel
carried in .whl/). Its EAGLE-3 trainer needs only torch, transformers and triton for this path;
`yunchang` (sequence-parallel kernels, unused here) is imported at module load, so a stub package is
written to a temporary folder and put on sys.path before importing SpecForge.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

import torch


def _stub_yunchang() -> None:
    root = os.path.join(tempfile.gettempdir(), "specforge_anchor_stub")
    pkg = os.path.join(root, "yunchang")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("")
    with open(os.path.join(pkg, "kernels.py"), "w") as f:
        f.write(
            "class AttnType:\n    pass\n\n\ndef select_flash_attn_impl(*a, **k):\n    raise RuntimeError('stub')\n"
        )
    with open(os.path.join(pkg, "globals.py"), "w") as f:
        f.write(
            "PROCESS_GROUP = None\n\n\ndef set_seq_parallel_pg(*a, **k):\n    raise RuntimeError('stub')\n"
        )
    if root not in sys.path:
        sys.path.append(root)


def specforge_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("specforge")
    except Exception:
        return None


def build_step(
    shape, inputs: dict, attention_backend: str = "flex_attention"
) -> Callable[[], float]:
    """One SpecForge training step (teacher from hidden states + 7-step TTT forward + backward) on
    the same synthetic inputs as our paths; returns a closure that runs it and gives the loss."""
    _stub_yunchang()
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.inter,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, vocab_size=shape.vocab, max_position_embeddings=8192,
        rms_norm_eps=1e-5, hidden_act="silu", pretraining_tp=1, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.draft_vocab_size = shape.draft_vocab
    cfg.target_hidden_size = shape.hidden
    cfg.rope_scaling = None  # transformers 5 default rope dict -> SpecForge's plain RoPE branch
    with torch.device("cuda"):
        model = LlamaForCausalLMEagle3(cfg, attention_backend=attention_backend)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embed"])
        model.t2d.copy_(inputs["t2d"])
        model.d2t.copy_(inputs["d2t"])
    model.embed_tokens.weight.requires_grad_(False)  # frozen, as SpecForge trains it
    eagle = OnlineEagle3Model(model, length=shape.ttt, attention_backend=attention_backend)
    T = inputs["ids"].shape[0]
    ids = inputs["ids"][None]
    attention_mask = torch.ones(1, T, dtype=torch.long, device="cuda")
    loss_mask = inputs["loss_mask"].to(torch.long)[None, :, None]
    aux = inputs["aux"][None]
    final = inputs["final_hidden"][None]

    def step() -> float:
        model.zero_grad(set_to_none=True)
        plosses, *_ = eagle(
            input_ids=ids, attention_mask=attention_mask, target=None, loss_mask=loss_mask,
            hidden_states=aux, target_hidden_for_compact=final, target_head_weight=inputs["head"],
        )  # fmt: skip
        loss = sum(0.8**i * p for i, p in enumerate(plosses))
        loss.backward()
        return loss.detach()

    step.model = model  # type: ignore[attr-defined]
    return step
