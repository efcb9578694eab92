"""Architecture config of an EAGLE-3 drafter, mirroring the `config.json` SGLang reads.

SGLang's `LlamaForCausalLMEagle3` takes a Llama config plus `draft_vocab_size`,
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`. vLLM reads a top-level
`eagle_aux_hidden_state_layer_ids` in its own convention (SGLang id + 1, see `vllm_layer_ids`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default when a drafter config names no ids: outputs of layers 1, N//2-1, N-4."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def rope_from_config_dict(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a config.json of either transformers generation: v4 writes
    top-level `rope_theta`/`rope_scaling`, v5 writes one `rope_parameters` dict (rope_type
    "default" = no scaling)."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def vllm_layer_ids(sglang_ids: list[int]) -> list[int]:
    """vLLM captures the *input* of layer j for id j; SGLang's id k is the *output* of layer k,
    i.e. the input of layer k+1. Same tensors, ids shifted by one."""
    return [k + 1 for k in sglang_ids]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # SGLang convention
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept verbatim

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json SGLang and vLLM load."""
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(self.aux_layer_ids),
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        return {**self.extra, **d}

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], source: str = "config.json") -> Eagle3Config:
        """Parse a drafter config.json; raises ValueError naming the missing field."""
        required = [
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "vocab_size",
        ]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(
                f"{source}: missing field(s) {missing}; an EAGLE-3 drafter config needs them"
            )
        heads = d["num_attention_heads"]
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None and "eagle_aux_hidden_state_layer_ids" in d:
            ids = [k - 1 for k in d["eagle_aux_hidden_state_layer_ids"]]  # vLLM convention
        known = set(cls.__dataclass_fields__) | {
            "architectures", "model_type", "num_hidden_layers", "tie_word_embeddings",
            "eagle_config", "eagle_aux_hidden_state_layer_ids", "rope_parameters", "dtype",
        }  # fmt: skip
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            aux_layer_ids=list(ids) if ids is not None else [],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_from_config_dict(d)[0],
            rope_scaling=rope_from_config_dict(d)[1],
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            hidden_act=d.get("hidden_act", "silu"),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
