"""Will this EAGLE-3 drafter work with this target (or: do these two drafters match)?

Reads config.json, tokenizer_config.json and safetensors headers only, never weights, so it runs
in seconds before any GPU time, also on HF repo ids (headers through the Hub's metadata API).
The command line is `python -m pipeline.compat` (pipeline/compat.py); the loop calls
`check_compat` before any GPU time.

Every mismatch is listed with the field, both sides and the fix. Rope and max positions only
warn: a drafter has its own rope, but one trained for another target usually shows up there first. With two drafters (`--target` also has an EAGLE-3 config)
they are compared config field by field and tensor by tensor.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from eagle3.checkpoint import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    canonical_names,
    expected_tensors,
    flatten_speculators_config,
    hub_file,
    read_safetensors_header,
)
from eagle3.config import Eagle3Config, default_aux_layer_ids, vllm_layer_ids
from eagle3.fit import AUX_COUNT, bad_aux_ids, drafter_fit
from eagle3.target_weights import (
    TargetInfo,
    read_target_config,
    resolve_target,
    target_info_from_dict,
)

# Config fields that change the drafter's tensors or the target features it reads.
ARCH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "aux_layer_ids",
    "hidden_act",
)
TOKENIZER_FIELDS = ("tokenizer_class", "bos_token", "eos_token")


@dataclass
class Row:
    field: str
    left: Any
    right: Any
    status: str  # ok | mismatch | warn | info
    fix: str = ""


@dataclass
class CompatReport:
    left: str
    right: str
    mode: str  # "drafter-target" or "drafter-drafter"
    rows: list[Row] = field(default_factory=list)

    @property
    def mismatches(self) -> list[dict[str, Any]]:
        return [_issue(r) for r in self.rows if r.status == "mismatch"]

    @property
    def warnings(self) -> list[dict[str, Any]]:
        return [_issue(r) for r in self.rows if r.status == "warn"]

    @property
    def compatible(self) -> bool:
        return not self.mismatches

    def add(
        self, name: str, left: Any, right: Any, ok: bool | None, fix: str = "", warn: bool = False
    ) -> None:
        """ok None = information only; a failed check is a mismatch, or a warning if `warn`."""
        status = "info" if ok is None else "ok" if ok else "warn" if warn else "mismatch"
        self.rows.append(
            Row(name, left, right, status, fix if status in ("mismatch", "warn") else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "compatible": self.compatible,
            "mode": self.mode,
            "left": self.left,
            "right": self.right,
            "mismatches": self.mismatches,
            "warnings": self.warnings,
            "rows": [asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        heads = (
            "field",
            "drafter" if self.mode == "drafter-target" else "left",
            "target" if self.mode == "drafter-target" else "right",
            "",
        )
        cells = [heads] + [(r.field, _short(r.left), _short(r.right), r.status) for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(3)]
        lines = [f"{self.left}  vs  {self.right}"]
        lines += ["  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells]
        issues = [r for r in self.rows if r.status in ("mismatch", "warn")]
        lines += [f"{r.status.upper()} {r.field}: {r.fix}" for r in issues]
        lines.append(
            "COMPATIBLE"
            if self.compatible
            else f"NOT COMPATIBLE: {len(self.mismatches)} mismatch(es)"
        )
        return "\n".join(lines)


def _issue(r: Row) -> dict[str, Any]:
    return {"field": r.field, "left": r.left, "right": r.right, "fix": r.fix}


def _short(v: Any, width: int = 48) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= width else s[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Reading one side


@dataclass
class _Drafter:
    raw: dict[str, Any]
    cfg: Eagle3Config
    headers: dict[str, tuple[str, tuple[int, ...]]] | None  # canonical names; None = unreadable
    tokenizer: dict[str, Any] | None


def _is_drafter_config(d: dict[str, Any]) -> bool:
    archs = " ".join(d.get("architectures") or [])
    return "Eagle3" in archs or "eagle_config" in d or "speculators_model_type" in d


def _read_drafter_json(path: str, revision: str | None) -> dict[str, Any]:
    f = hub_file(path, "config.json", revision)
    if f is None:
        raise CheckpointError(
            f"{path}/config.json: missing; a drafter folder needs config.json + model.safetensors"
        )
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}); re-download or re-export it") from None


def _read_drafter(
    raw: dict[str, Any], path: str, revision: str | None, label: str, rep: CompatReport
) -> _Drafter | None:
    try:
        cfg = Eagle3Config.from_json_dict(
            flatten_speculators_config(raw), source=f"{path}/config.json"
        )
    except ValueError as e:
        rep.add(f"{label} config.json", path, "unparseable", False, str(e))
        return None
    headers = None
    try:
        headers, _notes = canonical_names(read_safetensors_header(path, revision), path)
    except CheckpointError as e:
        rep.add(f"{label} safetensors", path, "unreadable", False, str(e))
    return _Drafter(raw, cfg, headers, _tokenizer_config(path, revision))


def _tokenizer_config(path: str, revision: str | None) -> dict[str, Any] | None:
    try:
        f = hub_file(path, "tokenizer_config.json", revision)
        return json.loads(f.read_text()) if f is not None else None
    except (CheckpointError, OSError, json.JSONDecodeError):
        return None  # optional: a missing tokenizer config only removes its rows


def _aux_ids(d: _Drafter, num_layers: int) -> tuple[list[int], bool]:
    """The drafter's SGLang ids, or SGLang's default for this target (flag True)."""
    if d.cfg.aux_layer_ids:
        return list(d.cfg.aux_layer_ids), False
    return default_aux_layer_ids(num_layers), True


# ---------------------------------------------------------------------------------------------
# Checks


def check_compat(
    drafter: str,
    target: str,
    *,
    drafter_revision: str | None = None,
    target_revision: str | None = None,
    gguf_file: str | None = None,
) -> CompatReport:
    """Compare a drafter with a target (or with another drafter); never reads weights."""
    drafter, target = str(drafter), str(target)
    rep = CompatReport(drafter, target, "drafter-target")
    try:
        draw = _read_drafter_json(drafter, drafter_revision)
    except CheckpointError as e:
        rep.add("drafter config.json", drafter, "missing or unreadable", False, str(e))
        return rep
    d = _read_drafter(draw, drafter, drafter_revision, "drafter", rep)
    try:
        traw = read_target_config(target, target_revision, gguf_file)
    except CheckpointError as e:
        rep.add("target config.json", target, "missing or unreadable", False, str(e))
        return rep

    if _is_drafter_config(traw):
        rep.mode = "drafter-drafter"
        other = _read_drafter(traw, target, target_revision, "right", rep)
        if d is not None and other is not None:
            _compare_drafters(d, other, rep)
        return rep
    try:
        info = target_info_from_dict(traw, source=target)
    except CheckpointError as e:
        rep.add("target config.json", target, "not a causal LM config", False, str(e))
        return rep
    if d is not None:
        is_gguf = resolve_target(target, gguf_file)[1] is not None  # GGUF has no tokenizer_config
        target_tok = None if is_gguf else _tokenizer_config(target, target_revision)
        _compare_with_target(d, info, target_tok, rep)
    return rep


def _compare_with_target(
    d: _Drafter, t: TargetInfo, target_tok: dict[str, Any] | None, rep: CompatReport
) -> None:
    c, h = d.cfg, d.headers or {}
    fit = {  # the one drafter-fits-target check (eagle3.fit); the rows below show it
        x.field: x
        for x in drafter_fit(
            c, vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=t.num_layers
        )
    }
    rep.add("architectures", d.raw.get("architectures"), list(t.architectures), None)
    rep.add("num_hidden_layers", d.raw.get("num_hidden_layers", 1), t.num_layers, None)
    for name in ("hidden_size", "target_hidden_size"):
        x = fit[name]
        rep.add(name, x.drafter, x.target, x.ok, x.fix)
    fc_in = h["fc.weight"][1][1] if "fc.weight" in h else None
    rep.add(
        "fc.weight in_features vs 3 x target hidden", fc_in, 3 * t.hidden_size, fc_in == 3 * t.hidden_size,
        "fc fuses three target hidden states; its input width must be 3 x the target's hidden_size "
        "(the drafter belongs to another target)",
    )  # fmt: skip
    x = fit["vocab_size"]
    rep.add("vocab_size", x.drafter, x.target, x.ok, x.fix)
    x = fit["draft_vocab_size"]
    rep.add("draft_vocab_size", x.drafter, x.target, x.ok, x.fix)
    _vocab_map_rows(d, t, rep)
    _aux_rows(d, t, rep)
    rep.add(
        "rope_theta", c.rope_theta, t.rope_theta, c.rope_theta == t.rope_theta,
        "drafters usually copy the target's rope; a different one hints at a drafter for another "
        "target", warn=True,
    )  # fmt: skip
    rep.add(
        "rope_scaling", c.rope_scaling, t.rope_scaling, c.rope_scaling == t.rope_scaling,
        "the drafter's rope scaling differs from the target's; long contexts may draft poorly",
        warn=True,
    )  # fmt: skip
    rep.add(
        "max_position_embeddings", c.max_position_embeddings, t.max_position_embeddings,
        c.max_position_embeddings >= t.max_position_embeddings,
        "the drafter covers fewer positions than the target; prompts past it draft poorly",
        warn=True,
    )  # fmt: skip
    rep.add("rms_norm_eps", c.rms_norm_eps, t.rms_norm_eps, None)
    rep.add("torch_dtype", c.torch_dtype, t.torch_dtype, None)
    if d.tokenizer and target_tok:
        for k in TOKENIZER_FIELDS:
            a, b = d.tokenizer.get(k), target_tok.get(k)
            rep.add(
                f"tokenizer {k}",
                a,
                b,
                a == b,
                "the drafter ships another tokenizer than the target",
                warn=True,
            )
    if d.headers is not None:
        _tensor_rows(d, rep)
        _param_rows(d.headers, rep, embed=(t.vocab_size, t.hidden_size))


def _vocab_map_rows(d: _Drafter, t: TargetInfo, rep: CompatReport) -> None:
    c, h = d.cfg, d.headers or {}
    flat = flatten_speculators_config(d.raw)
    if "draft_vocab_size" not in flat or flat.get("tie_word_embeddings"):
        rep.add(
            "lm_head source", "config lacks draft_vocab_size or ties embeddings", "drafter's own", False,
            "SGLang then serves with the target's lm_head and ignores the drafter's; write "
            "draft_vocab_size and tie_word_embeddings: false into config.json", warn=True,
        )  # fmt: skip
    identity = c.draft_vocab_size == c.vocab_size
    if "t2d" in h:
        n = h["t2d"][1][0] if h["t2d"][1] else None
        rep.add(
            "t2d length",
            n,
            t.vocab_size,
            n == t.vocab_size,
            "t2d must have one entry per target token",
        )
    else:
        rep.add("t2d length", "absent", t.vocab_size, None)
    if "d2t" in h or d.headers is None:
        return
    rep.add(
        "d2t", "absent", "identity" if identity else f"needed: draft vocab {c.draft_vocab_size} < {c.vocab_size}",
        identity, "SGLang serves wrong tokens without d2t; add the map the drafter was trained with",
    )  # fmt: skip


def _aux_rows(d: _Drafter, t: TargetInfo, rep: CompatReport) -> None:
    n = t.num_layers
    ids, is_default = _aux_ids(d, n)
    shown = f"{ids} (SGLang default)" if is_default else ids
    bad = bad_aux_ids(ids, n)
    rep.add(
        "aux_layer_ids (SGLang: output of layer k)", shown, f"valid 0..{n - 2} ({n} layers)", not bad,
        f"ids {bad} are outside 0..{n - 2}: SGLang captures the input of layer k+1, so k = {n - 1} "
        "and beyond never fire. Pick ids for this target (eagle_config.eagle_aux_hidden_state_layer_ids)",
    )  # fmt: skip
    rep.add(
        "aux_layer_ids (vLLM: input of layer j)", vllm_layer_ids(ids), f"valid 1..{n - 1}", None
    )
    rep.add(
        "aux_layer_ids count", len(ids), AUX_COUNT, len(ids) == AUX_COUNT,
        "SGLang's fc takes exactly three target hidden states; list three ids",
    )  # fmt: skip
    top = d.raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (d.raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is not None and nested is not None:
        rep.add(
            "aux ids: eagle_config (SGLang) vs top level (vLLM)", nested, top, list(top) == vllm_layer_ids(nested),
            "vLLM's top-level ids must be SGLang's + 1 (same layers); rewrite one of them",
        )  # fmt: skip


def _tensor_rows(d: _Drafter, rep: CompatReport) -> None:
    want = expected_tensors(d.cfg)
    h = d.headers or {}
    identity = d.cfg.draft_vocab_size == d.cfg.vocab_size
    for name in sorted(set(want) | set(h)):
        got = f"{h[name][0]} {list(h[name][1])}" if name in h else "missing"
        exp = (
            f"{_dtype_word(want[name][1])} {list(want[name][0])}"
            if name in want
            else "not an SGLang name"
        )
        if name not in want:
            rep.add(
                f"tensor {name}",
                got,
                exp,
                False,
                "SGLang drops unknown names silently; remove or rename it",
            )
        elif name not in h:
            ok = name in ("d2t", "t2d") and identity  # identity map is implied
            rep.add(
                f"tensor {name}", got, exp, ok, "the checkpoint lacks this tensor; re-export it"
            )
        else:
            ok = tuple(h[name][1]) == want[name][0] and _dtype_ok(h[name][0], want[name][1])
            rep.add(
                f"tensor {name}",
                got,
                exp,
                ok,
                "shape/dtype disagrees with config.json; fix the config or re-export",
            )


def _dtype_word(dt: Any) -> str:
    return "float" if dt is None else str(dt).removeprefix("torch.")


def _dtype_ok(header_dtype: str, want: Any) -> bool:
    dt = SAFETENSORS_DTYPES.get(header_dtype)
    if dt is None:
        return False
    if want is None:
        return dt.is_floating_point
    if want == SAFETENSORS_DTYPES["BOOL"]:
        return dt in (SAFETENSORS_DTYPES["BOOL"], SAFETENSORS_DTYPES["U8"])
    return not dt.is_floating_point and dt != SAFETENSORS_DTYPES["BOOL"]  # any integer d2t


def param_counts(headers: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """Trainable core (fc + midlayer + norm), lm_head (trainable, draft vocab) and buffers."""
    counts = {"core": 0, "lm_head": 0, "buffers": 0, "other": 0}
    for name, (_dt, shape) in headers.items():
        n = 1
        for s in shape:
            n *= s
        key = "buffers" if name in ("d2t", "t2d") else "lm_head" if name.startswith("lm_head.") else (
            "core" if name.startswith(("fc.", "midlayer.", "norm.")) else "other"
        )  # fmt: skip
        counts[key] += n
    return counts


def _param_rows(
    headers: dict, rep: CompatReport, embed: tuple[int, int] | None, right: dict | None = None
) -> None:
    """Parameter counts: people call a drafter "1B" or "2B" depending on whether they count the
    (frozen, target-owned) embedding and the lm_head; show each part."""
    a = param_counts(headers)
    b = param_counts(right) if right is not None else None
    rep.add("params trainable core (fc+midlayer+norm)", a["core"], b["core"] if b else "", None)
    rep.add(
        "params lm_head (trainable, draft vocab)", a["lm_head"], b["lm_head"] if b else "", None
    )
    rep.add(
        "params in checkpoint (core+lm_head)",
        a["core"] + a["lm_head"],
        b["core"] + b["lm_head"] if b else "",
        None,
    )
    if embed is not None:
        e = embed[0] * embed[1]
        rep.add("params embedding (frozen, the target's)", "not stored", e, None)
        rep.add("params at serve time (+embedding)", a["core"] + a["lm_head"] + e, "", None)


def _compare_drafters(a: _Drafter, b: _Drafter, rep: CompatReport) -> None:
    ca, cb = asdict(a.cfg), asdict(b.cfg)
    for k in ca:
        if k == "extra":
            continue
        ok = ca[k] == cb[k]
        fix = (
            "the drafters differ in architecture; they are not interchangeable"
            if k in ARCH_FIELDS
            else "differs"
        )
        rep.add(f"config {k}", ca[k], cb[k], ok, fix, warn=k not in ARCH_FIELDS)
    for k in sorted(set(a.cfg.extra) | set(b.cfg.extra)):
        va, vb = a.cfg.extra.get(k), b.cfg.extra.get(k)
        rep.add(f"config {k}", va, vb, va == vb, "differs", warn=True)
    if a.headers is None or b.headers is None:
        return
    for name in sorted(set(a.headers) | set(b.headers)):
        ha, hb = a.headers.get(name), b.headers.get(name)
        if ha is None or hb is None:
            rep.add(f"tensor {name}", _fmt(ha), _fmt(hb), False, "present in only one drafter")
        elif tuple(ha[1]) != tuple(hb[1]):
            rep.add(f"tensor {name}", _fmt(ha), _fmt(hb), False, "shapes differ")
        else:
            rep.add(
                f"tensor {name}",
                _fmt(ha),
                _fmt(hb),
                ha[0] == hb[0],
                "dtypes differ (cast on load)",
                warn=True,
            )
    _param_rows(a.headers, rep, embed=None, right=b.headers)


def _fmt(h: tuple[str, tuple[int, ...]] | None) -> str:
    return "missing" if h is None else f"{h[0]} {list(h[1])}"
