"""Independent oracles, called (never copied) by the tests: torchao 0.18 and aiter's pure-Python
helpers.

Some oracle modules cannot be imported here: `import aiter` loads ROCm machinery, aiter's
fp4_utils imports triton, and torchao's moe_training package imports a FlyDSL API that
flydsl 0.4.2 lacks. Their pure-PyTorch functions are taken from the installed files instead:
`load_module` runs a file that only needs torch; `load_functions` compiles just the named
top-level functions of a file (unchanged source) in a namespace that supplies what they use.
A missing package skips the dependent tests with the reason.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import pathlib
from types import SimpleNamespace
from typing import Optional, Tuple

import pytest
import torch


def _package_dir(name: str) -> Optional[pathlib.Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def load_module(path: pathlib.Path, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_functions(path: pathlib.Path, names, namespace: dict) -> SimpleNamespace:
    """Compile only the top-level functions `names` of `path`, with `namespace` as their globals."""
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in wanted}
    if missing:
        raise LookupError(f"{path} no longer defines {sorted(missing)}")
    for fn in wanted:
        fn.decorator_list = []
    module = ast.Module(body=wanted, type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)
    return SimpleNamespace(**{n: namespace[n] for n in names})


def torchao():
    """torchao 0.18's to_mx, to_dtype, ScaleCalculationMode, to_blocked and FP4 encoder, plus its
    moe_training scale layout helpers and 3D reference (loaded by source: that package's import
    fails with flydsl 0.4.2)."""
    pytest.importorskip("torchao", reason="torchao (the numerical oracle) is not installed")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.utils import ceil_div, to_blocked

    quant = _package_dir("torchao") / "prototype" / "moe_training" / "kernels" / "mxfp8" / "quant.py"
    namespace = {
        "torch": torch, "Tensor": torch.Tensor, "Tuple": Tuple, "ceil_div": ceil_div, "to_blocked": to_blocked,
        "to_mx": to_mx, "ScaleCalculationMode": ScaleCalculationMode,
    }
    moe = load_functions(
        quant,
        ["_to_scale_calculation_mode", "_to_column_major_per_group", "_to_blocked_per_group_3d_layout",
         "_mxfp8_quantize_reference_3d", "torch_to_blocked_2d_M_groups", "torch_to_blocked_2d_K_groups",
         "torch_to_blocked_per_group_3d"],
        namespace,
    )
    return SimpleNamespace(
        to_mx=to_mx, Mode=ScaleCalculationMode, to_blocked=to_blocked, to_dtype=to_dtype,
        f32_to_f4_unpacked=f32_to_f4_unpacked, moe=moe,
    )


def aiter_shuffle():
    """aiter/ops/shuffle.py (imports only torch): shuffle_weight_a16w4, shuffle_scale_a16w4."""
    root = _package_dir("aiter")
    if root is None:
        pytest.skip("amd-aiter (the layout oracle) is not installed")
    return load_module(root / "ops" / "shuffle.py", "aiter_ops_shuffle_oracle")


def aiter_fp4_utils():
    """e8m0_shuffle, mxfp4_to_f32 and e8m0_to_f32 from aiter/utility/fp4_utils.py (the module
    itself imports triton and aiter's chip detection, so only these torch functions are loaded)."""
    root = _package_dir("aiter")
    if root is None:
        pytest.skip("amd-aiter (the layout oracle) is not installed")
    dtypes = SimpleNamespace(fp8_e8m0=torch.float8_e8m0fnu, fp32=torch.float32)
    return load_functions(
        root / "utility" / "fp4_utils.py", ["e8m0_shuffle", "mxfp4_to_f32", "e8m0_to_f32"],
        {"torch": torch, "dtypes": dtypes, "math": math},
    )


def aiter_gemm_a4w4_reference():
    """run_torch, the torch reference of aiter's gemm_a4w4 tuner
    (aiter_meta/csrc/ck_gemm_a4w4_blockscale/gemm_a4w4_blockscale_tune.py): mxfp4_to_f32 of both
    operands times e8m0_to_f32 of their scales repeated over 32 columns, an FP32 matmul. It takes
    the plain (unshuffled) layouts; aiter has no inverse of its shuffles."""
    root = _package_dir("aiter")
    path = None if root is None else root.parent / "aiter_meta" / "csrc" / "ck_gemm_a4w4_blockscale" / "gemm_a4w4_blockscale_tune.py"
    if path is None or not path.exists():
        pytest.skip("amd-aiter's gemm_a4w4 tuner (the GEMM oracle) is not installed")
    return load_functions(path, ["run_torch"],
                          {"torch": torch, "fp4_utils": aiter_fp4_utils(), "SCALE_GROUP_SIZE": 32}).run_torch


def aiter_per_1x32_f4_quant():
    """aiter's pure-torch MXFP4 quantize, per_1x32_f4_quant from aiter/ops/quant.py, with the
    fp4_utils torch helpers it calls (f32_to_e8m0, e8m0_to_f32, f32_to_mxfp4 and what that uses;
    fp4_utils' module constants supplied with the values that file defines). Its scale is
    f32_to_e8m0(amax / 4): amax's exponent, +1 from mantissa 0.5 on (its line with torchao's EVEN
    rounding, + 0x200000, is commented out in this aiter), so it equals "even" on blocks whose
    amax mantissa is outside [0.5, 0.75)."""
    root = _package_dir("aiter")
    if root is None:
        pytest.skip("amd-aiter (the oracle) is not installed")
    dtypes = SimpleNamespace(fp8_e8m0=torch.float8_e8m0fnu, fp32=torch.float32, fp4x2=torch.float4_e2m1fn_x2)
    ns = {"torch": torch, "Tensor": torch.Tensor, "dtypes": dtypes, "EBITS_F32": 8, "MBITS_F32": 23,
          "F32_EXP_BIAS": 127}
    fp4 = load_functions(root / "utility" / "fp4_utils.py",
                         ["f32_to_e8m0", "e8m0_to_f32", "f32_to_mxfp4", "e8m0_shuffle", "pack_uint4", "down_size",
                          "_n_ones", "_f32_to_floatx_unpacked"], ns)
    return load_functions(root / "ops" / "quant.py", ["per_1x32_f4_quant"],
                          {"torch": torch, "dtypes": dtypes, "fp4_utils": fp4}).per_1x32_f4_quant
