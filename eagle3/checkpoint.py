"""EAGLE-3 drafter checkpoints in the layout SGLang's `LlamaForCausalLMEagle3` loads.

A checkpoint is a folder with `config.json` and `model.safetensors`; tensor names have no prefix
(`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`) and there is no
embedding: SGLang always feeds the target's. SGLang drops unknown names silently and serves
garbage without `d2t`, so both directions here are strict and every problem is listed at once.

`load_drafter` also reads sharded checkpoints (index json), the speculators layout
(`layers.0.*`, nested `transformer_layer_config`) and `model.`-prefixed names, and returns the
canonical SGLang names.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.config import Eagle3Config

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header

# torch dtype of each safetensors dtype string (header values)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A drafter checkpoint (or a path to one) that cannot be used; the message says the fix."""


# ---------------------------------------------------------------------------------------------
# Expected tensors


def expected_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype) of every tensor SGLang loads for `cfg`; dtype None = any float.

    The attention input is 2H wide: SGLang's midlayer concatenates the normed token embedding and
    the normed hidden state before q/k/v. `fc` fuses three target layers (3 x target hidden).
    """
    h, ht, inter = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    names: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "fc.weight": ((h, 3 * ht), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.o_proj.weight": ((h, q), None),
        "midlayer.mlp.gate_proj.weight": ((inter, h), None),
        "midlayer.mlp.up_proj.weight": ((inter, h), None),
        "midlayer.mlp.down_proj.weight": ((h, inter), None),
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, h), None),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }
    if cfg.extra.get("bias"):  # SGLang builds fc with bias=config.bias
        names["fc.bias"] = ((h,), None)
    return names


def check_state(shapes: dict[str, tuple[int, ...]], cfg: Eagle3Config, source: str) -> list[str]:
    """Every naming and shape problem of `shapes` (name -> shape) against `cfg`, one line each."""
    want = expected_tensors(cfg)
    problems = []
    unknown = sorted(set(shapes) - set(want))
    missing = sorted(set(want) - set(shapes))
    if unknown:
        problems.append(
            f"{source}: unknown tensor(s) {unknown}; SGLang would drop them silently. Rename them "
            "to SGLang's names (eagle3.checkpoint.expected_tensors) or remove them"
        )
    if missing:
        problems.append(
            f"{source}: missing tensor(s) {missing}; the checkpoint is incomplete for this "
            "config.json. Re-export it with eagle3.checkpoint.save_drafter or fix config.json"
        )
    for name in sorted(set(want) & set(shapes)):
        if tuple(shapes[name]) != want[name][0]:
            problems.append(
                f"{source}: {name} has shape {list(shapes[name])}, config.json implies "
                f"{list(want[name][0])}; the config does not describe these weights"
            )
    return problems


def check_vocab_map(
    d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, source: str
) -> list[str]:
    """SGLang serves token `i + d2t[i]` for draft id i: every such id must exist and be unique,
    and `t2d` (used by training) must mark exactly those ids."""
    d2t, t2d = d2t.detach().cpu(), t2d.detach().cpu()
    target_ids = torch.arange(d2t.numel()) + d2t.to(torch.int64)
    problems = []
    if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        problems.append(
            f"{source}: d2t maps draft ids to target ids outside [0, {vocab_size}); the map was "
            "built for another vocabulary. Rebuild it from this target's tokens"
        )
        return problems
    if torch.unique(target_ids).numel() != target_ids.numel():
        problems.append(f"{source}: d2t maps two draft ids to the same target id; rebuild the map")
    marked = torch.zeros(vocab_size, dtype=torch.bool)
    marked[target_ids] = True
    if t2d.numel() == vocab_size and not torch.equal(marked, t2d.to(torch.bool)):
        problems.append(
            f"{source}: t2d does not mark exactly the target ids of d2t; rebuild t2d from d2t"
        )
    return problems


# ---------------------------------------------------------------------------------------------
# Save


def save_drafter(
    state: dict[str, torch.Tensor],
    cfg: Eagle3Config,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `config.json` + `model.safetensors` atomically: into a temp folder beside `out_dir`,
    then renamed into place, so a crash never leaves a half checkpoint under `out_dir`."""
    out = Path(out_dir)
    problems = check_state({k: tuple(v.shape) for k, v in state.items()}, cfg, "state dict")
    if not problems:
        problems = check_vocab_map(state["d2t"], state["t2d"], cfg.vocab_size, "state dict")
    if problems:
        raise CheckpointError("cannot save drafter:\n  " + "\n  ".join(problems))
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: is a file; pass a folder path for the checkpoint")
    stray = (
        [p.name for p in out.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME)]
        if out.is_dir()
        else []
    )
    if stray:
        raise CheckpointError(
            f"{out}: holds other files {sorted(stray)}; save into a new or empty folder"
        )

    tensors = {name: _cast(name, t, dtype) for name, t in state.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    config = replace(cfg, torch_dtype=dtype_name).to_json_dict()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(
        0o755
    )  # mkdtemp's 0700 would hide the checkpoint from a server running as another user
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        _save_file(tensors, tmp / WEIGHTS_NAME)
        for f in (tmp / CONFIG_NAME, tmp / WEIGHTS_NAME):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = out.parent / tmp.name.replace(".tmp-", ".old-", 1)
        if out.exists():
            out.rename(old)  # the one window without `out`; the old copy stays beside it
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) spells an I/O error


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with an I/O error (a full disk: `os error 28`) raised as the
    OSError it is, naming the file: the caller tells a full disk apart by its errno
    (actors/files.py `disk_full`), where SafetensorError's text alone would reach the user."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:  # SafetensorError
        if m := _OS_ERROR.search(str(e)):
            raise OSError(int(m[1]), f"{path}: {e}") from e
        raise


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach().to("cpu")
    if name == "d2t":
        t = t.to(torch.int64)
    elif name == "t2d":
        t = t.to(torch.bool)
    else:
        t = t.to(dtype)
    return t.contiguous()


# ---------------------------------------------------------------------------------------------
# Load


def load_drafter(
    path_or_repo: str | os.PathLike, revision: str | None = None
) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Read a drafter from a local folder or an HF repo id; returns SGLang-named tensors.

    Strict: unknown or missing names, wrong shapes and a bad vocab map raise one CheckpointError
    listing them all. `d2t`/`t2d` may be absent only when draft vocab == vocab (identity map).
    """
    folder = local_or_download(
        path_or_repo, revision, ["config.json", "*.safetensors", "*.safetensors.index.json"]
    )
    cfg = read_drafter_config(folder / CONFIG_NAME)
    raw = _read_all_tensors(folder)
    state, notes = canonical_names(raw, str(folder))
    for note in notes:
        log.warning(note)

    if "d2t" not in state and "t2d" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        log.warning("%s: no d2t/t2d and draft vocab == vocab; using the identity map", folder)
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    elif "t2d" not in state and "d2t" in state and state["d2t"].numel() == cfg.draft_vocab_size:
        state["t2d"] = _t2d_from_d2t(state["d2t"], cfg.vocab_size)  # SGLang never reads t2d
        log.warning("%s: no t2d; rebuilt it from d2t", folder)

    problems = check_state({k: tuple(v.shape) for k, v in state.items()}, cfg, str(folder))
    if "d2t" not in state:
        problems.append(
            f"{folder}: no d2t but draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
            f"{cfg.vocab_size}; SGLang would serve wrong tokens. Add the d2t the drafter was "
            "trained with (d2t[i] = target_id - i)"
        )
    if not problems:
        problems = check_vocab_map(state["d2t"], state["t2d"], cfg.vocab_size, str(folder))
    if problems:
        raise CheckpointError("cannot load drafter:\n  " + "\n  ".join(problems))
    state["d2t"] = state["d2t"].to(torch.int64)
    state["t2d"] = state["t2d"].to(torch.bool)
    return cfg, state


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    ids = torch.arange(d2t.numel()) + d2t.to(torch.int64)
    t2d[ids.clamp(0, vocab_size - 1)] = True  # out-of-range ids are reported by check_vocab_map
    return t2d


def canonical_names(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """Map accepted aliases to SGLang's names: speculators `layers.0.*` -> `midlayer.*`, a
    `model.` prefix (SGLang accepts it) is stripped, `embed_tokens.weight` dropped (SGLang uses
    the target's). Works on any name -> value dict (tensors or header entries)."""
    out: dict[str, Any] = {}
    notes = []
    for name, value in raw.items():
        canon = name.removeprefix("model.")
        if canon.startswith("layers.0."):
            canon = "midlayer." + canon.removeprefix("layers.0.")
        if canon == "embed_tokens.weight":
            notes.append(f"{source}: dropped {name}; SGLang always uses the target's embedding")
            continue
        if canon in out:
            raise CheckpointError(
                f"{source}: {name} and another tensor both map to {canon}; keep one"
            )
        out[canon] = value
    return out, notes


def read_drafter_config(path: Path) -> Eagle3Config:
    """Parse a drafter config.json (SGLang's or the speculators layout)."""
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; a drafter folder needs config.json next to its weights"
        )
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path}: not valid JSON ({e}); re-download or re-export it"
        ) from None
    try:
        return Eagle3Config.from_json_dict(flatten_speculators_config(d), source=str(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def flatten_speculators_config(d: dict[str, Any]) -> dict[str, Any]:
    """speculators keeps the Llama fields under `transformer_layer_config` and the aux ids at the
    top level in vLLM's convention; lift them into one flat dict (SGLang-like)."""
    if "transformer_layer_config" not in d:
        return d
    flat = dict(d["transformer_layer_config"])
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if d.get(key) is not None:
            flat[key] = d[key]
    if d.get("norm_before_residual"):
        log.warning("speculators config: norm_before_residual=true is not SGLang's midlayer math")
        flat["norm_before_residual"] = True
    flat.setdefault("vocab_size", d.get("target_vocab_size"))
    return flat


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those of the index, else all of them."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}); re-download it") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(
                f"{index}: names shard(s) {absent} that are not in {folder}; download them"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors file; expected {WEIGHTS_NAME}")
    return files


def _read_all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        read_safetensors_header(f)  # a clear error for a truncated or foreign file
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name in tensors:
                    raise CheckpointError(f"{f}: tensor {name} appears in two shards; keep one")
                tensors[name] = fh.get_tensor(name)
    return tensors


# ---------------------------------------------------------------------------------------------
# Headers and the hub


def read_safetensors_header(
    path: str | os.PathLike, revision: str | None = None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype string, shape), reading only header bytes.

    `path` is a .safetensors file, a checkpoint folder (all its files) or an HF repo id (through
    huggingface_hub's safetensors metadata API, no weights downloaded).
    """
    p = Path(path)
    if p.is_dir():
        merged: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in weight_files(p):
            merged.update(read_safetensors_header(f))
        return merged
    if p.is_file():
        return _read_header_file(p)
    if not is_repo_id(str(path)):
        raise CheckpointError(
            f"{path}: no such file or folder; pass a .safetensors file, a folder or a repo id"
        )
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(str(path), revision=revision)
    except Exception as e:
        raise CheckpointError(_hub_error(str(path), e)) from None
    return {
        name: (info.dtype, tuple(info.shape))
        for fmeta in meta.files_metadata.values()
        for name, info in fmeta.tensors.items()
    }


def _read_header_file(p: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    fix = "the file is truncated or not safetensors; re-download or re-save it"
    size = p.stat().st_size
    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{p}: {size} bytes, too short for a safetensors header; {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise CheckpointError(
                f"{p}: header length {n} does not fit the file ({size} bytes); {fix}"
            )
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{p}: header is not JSON ({e}); {fix}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: header is not a JSON object; {fix}")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            out[name] = (str(info["dtype"]), tuple(int(s) for s in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{p}: header entry {name!r} lacks dtype/shape/data_offsets; {fix}"
            ) from None
        if end > size - 8 - n:
            raise CheckpointError(f"{p}: tensor {name} ends past the end of the file; {fix}")
    return out


def is_repo_id(s: str) -> bool:
    """`org/name` that is not a local path."""
    parts = s.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not s.startswith((".", "/", "~"))
        and not Path(s).exists()
    )


def local_or_download(
    path_or_repo: str | os.PathLike, revision: str | None, patterns: list[str]
) -> Path:
    """A local folder as is; an HF repo id through snapshot_download of `patterns` only."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p}: a file, not a folder; pass the checkpoint folder")
    if not is_repo_id(str(path_or_repo)):
        raise CheckpointError(
            f"{p}: no such folder; pass a local checkpoint folder or an HF repo id (org/name)"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(str(path_or_repo), revision=revision, allow_patterns=patterns)
        )
    except Exception as e:
        raise CheckpointError(_hub_error(str(path_or_repo), e)) from None


def hub_file(
    path_or_repo: str | os.PathLike, filename: str, revision: str | None = None
) -> Path | None:
    """One file of a local folder or HF repo; None when the folder/repo has no such file."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        f = p / filename
        return f if f.is_file() else None
    if not is_repo_id(str(path_or_repo)):
        raise CheckpointError(
            f"{p}: no such folder; pass a local folder or an HF repo id (org/name)"
        )
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(str(path_or_repo), filename, revision=revision))
    except LocalEntryNotFoundError as e:  # offline: a subclass of EntryNotFoundError
        raise CheckpointError(_hub_error(str(path_or_repo), e)) from None
    except EntryNotFoundError:
        return None
    except Exception as e:
        raise CheckpointError(_hub_error(str(path_or_repo), e)) from None


def _hub_error(repo: str, e: Exception) -> str:
    return (
        f"{repo}: not a local folder, and fetching it from the HF Hub failed "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass a local folder, "
        "check the repo id / revision / HF_TOKEN, or run where the Hub is reachable "
        "(HF_HUB_OFFLINE=1 uses only the local cache)"
    )
