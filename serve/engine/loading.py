"""Loading: the target (HF repo, folder or GGUF) and an EAGLE-3 drafter checked against it, or a
random drafter shaped like the target (cycle overhead)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3.config import Eagle3Config, default_aux_layer_ids
from eagle3.fit import drafter_fit_problems
from eagle3.model import Eagle3Drafter, drafter_from_state
from serve.engine.drafting import EagleDraft
from serve.engine.eager import decoder_layers

# ----------------------------------------------------------------------------------------------
# Loading


def load_target(
    model: str,
    gguf_file: str | None = None,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    device: str | None = None,
):
    """(model, tokenizer) of an HF causal LM; `smollm2` resolves to the bundled GGUF. `device`
    ("cuda", "cpu"; None = cpu) is where the weights go: on CUDA `SpecEngine` uses its
    static-cache, CUDA-graph runner."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.hf_folder import local_target
    from eagle3.train_step import target_dtype

    dt = target_dtype(dtype, torch.device(device).type if device else "cpu")
    path, gguf = local_target(model, gguf_file, dt)  # a GGUF: its folder, converted once
    kw: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if gguf:
        kw["gguf_file"] = gguf
    tok = AutoTokenizer.from_pretrained(path, **kw)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dt, **kw).eval()
    return (lm.to(device) if device else lm), tok


def check_drafter_for_target(
    cfg: Eagle3Config, vocab_size: int, hidden_size: int, num_layers: int, source: str
) -> list[str]:
    """Every way a drafter config does not fit the target, one line each (eagle3.fit)."""
    return drafter_fit_problems(
        cfg, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, source=source
    )


def load_eagle(path: str | Path, target: torch.nn.Module) -> EagleDraft:
    """Load an EAGLE-3 checkpoint (strict) and check it against the loaded target; raises
    ValueError listing every mismatch."""
    from eagle3.checkpoint import load_drafter

    cfg, state = load_drafter(path)
    emb = target.get_input_embeddings().weight
    n_layers = len(decoder_layers(target))
    problems = check_drafter_for_target(cfg, emb.shape[0], emb.shape[1], n_layers, str(path))
    if problems:
        raise ValueError("drafter does not fit the target:\n  " + "\n  ".join(problems))
    if not cfg.aux_layer_ids:
        cfg.aux_layer_ids = default_aux_layer_ids(n_layers)
    model = drafter_from_state(cfg, state, emb.detach().float()).to(emb.device)
    return EagleDraft(model, str(path))


def random_drafter(
    target: torch.nn.Module,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    aux_layer_ids: list[int] | None = None,
) -> EagleDraft:
    """An untrained drafter shaped like the target (accept_len ~1): measures cycle overhead."""
    c = target.config
    n_layers = len(decoder_layers(target))
    emb = target.get_input_embeddings().weight.detach().float()
    vocab = emb.shape[0]
    heads = c.num_attention_heads
    cfg = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size or vocab, vocab),
        target_hidden_size=c.hidden_size,
        aux_layer_ids=aux_layer_ids or default_aux_layer_ids(n_layers),
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_theta=float(
            getattr(c, "rope_theta", None)
            or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        ),
        max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
    )
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, emb)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    g = torch.Generator().manual_seed(seed)
    used = torch.sort(torch.randperm(vocab, generator=g)[: cfg.draft_vocab_size]).values
    model.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
    model.t2d.zero_()
    model.t2d[used] = True
    return EagleDraft(model.to(emb.device), "random")
