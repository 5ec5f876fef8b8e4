"""flyquant.compat.torchao keeps torchao 0.18's FlyDSL op signatures and output contracts."""

import ast
import inspect

import pytest
import torch

from flyquant import reference
from flyquant.compat import torchao as compat

OPS = ("mxfp8_quantize_2d_1x32_flydsl", "mxfp8_quantize_2d_32x1_flydsl", "mxfp8_quantize_3d_flydsl")


def _torchao_signatures() -> dict:
    """Parameter (name, default) lists of torchao's public wrappers, read from its source: the
    package cannot be imported with flydsl 0.4.2 (it needs flydsl.expr.vector)."""
    spec = pytest.importorskip("torchao", reason="torchao (the signature oracle) is not installed")
    import pathlib

    path = pathlib.Path(spec.__file__).parent / "prototype/moe_training/kernels/mxfp8/quant.py"
    tree = ast.parse(path.read_text())
    sigs = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in OPS:
            args = node.args.args
            defaults = [None] * (len(args) - len(node.args.defaults)) + [ast.literal_eval(d) for d in node.args.defaults]
            sigs[node.name] = [(a.arg, d) for a, d in zip(args, defaults)]
    return sigs


def test_signatures_match_torchao_018():
    sigs = _torchao_signatures()
    assert set(sigs) == set(OPS)
    for name in OPS:
        ours = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                for p in inspect.signature(getattr(compat, name)).parameters.values()]
        assert ours == sigs[name], name


def test_outputs_follow_torchao_contract():
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 10
    d, s = compat.mxfp8_quantize_2d_1x32_flydsl(x, scaling_mode="floor")
    rd, rs = reference.mxfp8_quantize(x, -1, "floor")
    assert d.stride() == (96, 1) and s.shape == (64, 3)
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))

    d, s = compat.mxfp8_quantize_2d_32x1_flydsl(x)
    assert d.stride() == (1, 64) and s.shape == (96, 2)
    d, s = compat.mxfp8_quantize_2d_32x1_flydsl(x, blocked_scale_output=True)
    assert s.shape == (128 * 4,)  # torchao: ceil(K/128)*128 rows x ceil(M/32/4)*4 cols, flat

    w = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    d, s = compat.mxfp8_quantize_3d_flydsl(w, scale_block_dim2=32)
    assert d.stride() == (64 * 64, 1, 64) and s.shape == (2, 2, 2)
    d, s = compat.mxfp8_quantize_3d_flydsl(w, blocked_scale_output=True)
    assert s.shape == (2, 128 * 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 16}, "block_size must be 32"),
    ({"scaling_mode": "even"}, "scaling_mode"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compat.mxfp8_quantize_2d_1x32_flydsl(torch.zeros(32, 32, dtype=torch.bfloat16), **kwargs)
    with pytest.raises(ValueError, match="scale_block_dim1 must be 32"):
        compat.mxfp8_quantize_3d_flydsl(torch.zeros(1, 32, 32), scale_block_dim1=16)
