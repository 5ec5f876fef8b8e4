"""flyquant.compat.torchao keeps torchao 0.18's FlyDSL op signatures and output contracts."""

import ast
import inspect
import re

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


BF16 = torch.bfloat16
ONE_X32, COL, THREE_D = compat.mxfp8_quantize_2d_1x32_flydsl, compat.mxfp8_quantize_2d_32x1_flydsl, compat.mxfp8_quantize_3d_flydsl
_t = torch.zeros(2, 64, 64, dtype=BF16)
# (call, torchao's words, our words after them or None): each bad input to a compat function.
BAD_INPUTS = [
    (lambda: ONE_X32(torch.zeros(32, 32, dtype=BF16), block_size=16), r"Only block_size=32 is supported", "got 16"),
    (lambda: COL(torch.zeros(32, 32, dtype=BF16), block_size=32.0), r"Only block_size=32 is supported",
     "got 32.0"),  # accepted, while scale_block_dim2=32.0 was refused
    (lambda: ONE_X32(torch.zeros(4, 40, dtype=BF16)), r"K must be a multiple of 32", "got K = 40"),
    (lambda: ONE_X32(torch.zeros(64, 64, dtype=BF16).t()), r"Input tensor must be contiguous \(row-major\)",
     r"got strides \(1, 64\)"),
    (lambda: ONE_X32(torch.zeros(32, 32, dtype=torch.int32)), r"Input tensor must be float32 or bfloat16", "float16"),
    (lambda: ONE_X32(torch.zeros(32, 32, dtype=BF16), scaling_mode="even"), r"scaling_mode must be one of", None),
    (lambda: ONE_X32(torch.zeros(32, 32, dtype=BF16), offs=torch.tensor([64], dtype=torch.int32)), r"offs", None),
    (lambda: ONE_X32(torch.zeros(64, 32, dtype=BF16), offs=torch.tensor([32, 64])), r"offs", "int32"),  # int64: a TypeError
    (lambda: COL(torch.zeros(64, 32, dtype=BF16), offs=[32, 64]), r"offs", None),  # no tensor: a TypeError
    (lambda: COL(torch.zeros(64, 32, dtype=BF16), blocked_scale_output="no"), r"blocked_scale_output must be a bool",
     None),  # a truth test would take it as True
    (lambda: THREE_D(torch.zeros(1, 32, 32, dtype=BF16), blocked_scale_output=1), r"blocked_scale_output must be a bool",
     None),
    (lambda: COL(torch.zeros(40, 32, dtype=BF16)), r"M \(40\) must be a multiple of block_size \(32\)", None),
    (lambda: COL(torch.zeros(32, dtype=BF16)), r"input tensor must be 2D", None),
    (lambda: THREE_D(torch.zeros(1, 40, 32, dtype=BF16)), r"N must be divisible by block_size", "got N = 40"),
    (lambda: THREE_D(torch.zeros(1, 32, 40, dtype=BF16), scale_block_dim2=32),
     r"K \(40\) must be divisible by BLOCK_SIZE \(32\)", None),
    (lambda: THREE_D(_t[:, :, ::2]), r"Input tensor must be contiguous \(row-major\)", None),
    (lambda: THREE_D(_t.transpose(1, 2)[:, ::2], scale_block_dim2=32), r"Input tensor must be contiguous \(row-major\)",
     None),
]


@pytest.mark.parametrize("i", range(len(BAD_INPUTS)))
def test_errors_are_torchaos_assertion_and_our_value_error(i):
    call, words, ours = BAD_INPUTS[i]
    with pytest.raises(AssertionError, match="^" + words) as caught:  # as torchao raises it, its words first
        call()
    assert isinstance(caught.value, ValueError)  # and as flyquant's native API raises it
    if ours:
        assert re.search(ours, str(caught.value)), str(caught.value)


def test_bad_dtype_is_also_our_type_error():
    with pytest.raises(TypeError):  # the native API's class for a dtype
        ONE_X32(torch.zeros(32, 32, dtype=torch.int32))


@pytest.mark.parametrize("kwargs, words", [
    ({"scale_block_dim1": 16}, "scale_block_dim1 must be 32 (got 16)"),
    ({"scale_block_dim2": 16}, "scale_block_dim2 must be 1 or 32 (got 16)"),
    # not ints: were refused by the native API naming its scale_block_k
    ({"scale_block_dim2": 32.0}, "scale_block_dim2 must be 1 or 32 (got 32.0)"),
    ({"scale_block_dim2": True}, "scale_block_dim2 must be 1 or 32 (got True)"),
    ({"scale_block_dim1": 32.0}, "scale_block_dim1 must be 32 (got 32.0)"),  # was accepted
])
def test_3d_scale_blocks_are_torchaos_not_implemented_and_our_value_error(kwargs, words):
    with pytest.raises(NotImplementedError, match=words.replace("(", r"\(").replace(")", r"\)")) as caught:
        THREE_D(torch.zeros(1, 32, 32), **kwargs)
    assert isinstance(caught.value, ValueError)


def test_native_api_keeps_value_error():
    import flyquant as fq
    with pytest.raises(ValueError) as caught:
        fq.mxfp8_quantize(torch.zeros(40, 32, dtype=BF16), axis=0)
    assert not isinstance(caught.value, AssertionError)


@pytest.mark.parametrize("block_k", (1, 32))
@pytest.mark.parametrize("blocked", (False, True))
def test_3d_takes_torchaos_transposed_weights(block_k, blocked):
    w = torch.randn(2, 96, 64, dtype=BF16).transpose(1, 2)  # (E, N=64, K=96), strides (N*K, 1, N)
    d, s = THREE_D(w, scale_block_dim2=block_k, blocked_scale_output=blocked)
    rd, rs = reference.mxfp8_quantize_3d(w.contiguous(), "rceil", block_k, "tcgen05" if blocked else None)
    assert d.stride() == rd.stride() == (64 * 96, 1, 64)
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


def test_a_scaling_mode_that_is_no_string_is_shown_as_given():
    """scaling_mode went through str().lower(): None was refused as "got 'none'", 1 as "got '1'"."""
    for mode in (None, 1):
        with pytest.raises(ValueError, match=re.escape(f"scaling_mode must be one of ('floor', 'rceil'), got {mode!r}")):
            ONE_X32(torch.zeros(32, 32, dtype=BF16), scaling_mode=mode)
    assert torch.equal(ONE_X32(torch.ones(32, 32, dtype=BF16), scaling_mode="FLOOR")[1].view(torch.uint8),
                       reference.mxfp8_quantize(torch.ones(32, 32, dtype=BF16), -1, "floor")[1].view(torch.uint8))
