"""The CPU regime (eagle3/cpu.py cpu_regime): bf16 where the CPU's flags say its matmuls
are native, fp32 elsewhere, and the switch that runs a bf16 CPU as an fp32 one."""

from __future__ import annotations

import pytest
import torch

from eagle3.cpu import CPU_BF16_ENV, cpu_flags, cpu_regime, top1
from eagle3.train_step import compute_dtype, target_dtype

pytestmark = pytest.mark.ray_free

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
SKYLAKE = frozenset({"avx2", "avx512f", "fma"})


@pytest.mark.parametrize(
    ("flags", "regime"), [(ZEN4, "bf16"), (SAPPHIRE_RAPIDS, "bf16"), (SKYLAKE, "fp32")]
)
def test_the_regime_follows_the_cpus_flags(flags, regime, monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    name, why = cpu_regime(flags)
    assert name == regime
    assert ("native bf16 matmuls" if regime == "bf16" else "bf16 would be emulated") in why


def test_auto_dtypes_follow_this_machines_flags(monkeypatch):
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    want = torch.bfloat16 if native else torch.float32
    assert target_dtype("auto", "cpu") == want
    assert compute_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else None)


def test_the_switch_runs_a_bf16_cpu_in_the_fp32_regime(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert cpu_regime(SAPPHIRE_RAPIDS)[0] == "fp32"
    assert target_dtype("auto", "cpu") == torch.float32
    assert compute_dtype("auto", torch.device("cpu")) is None
    assert target_dtype("auto", "cuda") == torch.bfloat16  # a GPU is not a CPU regime


@pytest.mark.parametrize("value", ["off", "false", "no"])
def test_a_switch_value_it_does_not_know_is_refused_naming_the_variable(value, monkeypatch):
    """`EAGLE_LOOP_CPU_BF16=off` once ran bf16 silently, as if unset."""
    monkeypatch.setenv(CPU_BF16_ENV, value)
    with pytest.raises(ValueError, match=f"{CPU_BF16_ENV}='{value}': set 0"):
        cpu_regime(SAPPHIRE_RAPIDS)
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    assert cpu_regime(SAPPHIRE_RAPIDS)[0] == "bf16"


def test_preflight_names_a_bad_switch_before_anything_starts(monkeypatch, tiny_target):
    from pipeline.config import parse_config
    from pipeline.preflight import PreflightError, preflight

    monkeypatch.setenv(CPU_BF16_ENV, "off")
    with pytest.raises(PreflightError, match=f"{CPU_BF16_ENV}='off'"):
        preflight(parse_config({"target": {"model": str(tiny_target)}}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top1_is_argmax_with_its_ties_and_nans(dtype):
    """`top1` (max's index, faster on a CPU) picks what argmax picks: the first of tied maxima,
    and a NaN over any number; rows of the widths the loop reduces, and a batch of rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8192, generator=g).to(dtype)
    x[1, [7, 300, 8000]] = 50.0  # a three-way tie: the first wins
    x[2, :] = 1.0  # every entry tied
    x[3, 4000] = float("nan")
    x[4, [10, 20]] = float("nan")  # two NaNs: the first
    assert torch.equal(top1(x), x.argmax(-1))
    assert top1(x)[1] == 7 and top1(x)[2] == 0 and top1(x)[4] == 10
    y = torch.randn(2, 3, 49152, generator=g).to(dtype)
    assert torch.equal(top1(y), y.argmax(-1))
