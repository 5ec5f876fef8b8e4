"""flyquant.training.mxfp8_grouped_mm, the autograd op of MoE training (issue 22): forward, dgrad
and wgrad against the BF16 autograd of the same grouped matmul and against the contract's exact
GEMM operands, rows past the last group, torch.compile, bad input; on a real GPU the first again.

Tolerance, derived (fp32_bound: tests/test_grouped_mm.py):
- MX quantization (training op vs the BF16 autograd of the unquantized matmul): with rceil an
  E4M3 element is within 2^-4 |x| (3 mantissa bits, round to nearest) of x, or 2^-10 * scale
  absolutely in E4M3's subnormal range, and the block scale is < amax / 224 (amax / 448 rounded
  up to a power of two). So |q(x) - x| <= e(x) = 2^-4 |x| + 2^-10 amax / 224 per element, and a
  product errs by at most e(a)|b| + |a|e(b) + e(a)e(b), summed over K (`_product_bound`), plus
  the FP32 accumulation and BF16 rounding of both sides (fp32_bound on magnitudes |exact| +
  bound; torch._grouped_mm in BF16, the other side, accumulates in FP32 as the op does).
"""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
from flyquant import reference, select, training
from flyquant.formats import MX_BLOCK
from mx_fp64 import deq64, grouped64, groups  # the independent FP64 model
from test_grouped_mm import E4M3, assert_within, fp32_bound, offs


def test_training_op_bad_inputs(reference_backend):
    A = torch.randn(64, 64, dtype=torch.bfloat16)
    B_t = torch.randn(2, 64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="B_t.shape"):
        training.mxfp8_grouped_mm(A, B_t[:, :32], offs(32, 64))
    with pytest.raises(ValueError, match="N, quantized in blocks of 32"):
        training.mxfp8_grouped_mm(A, B_t[:, :, :16], offs(32, 64))
    with pytest.raises(ValueError, match="scaling_mode"):
        training.mxfp8_grouped_mm(A, B_t, offs(32, 64), scaling_mode="even")
    with pytest.raises(TypeError, match="A must have dtype"):
        training.mxfp8_grouped_mm(A.to(E4M3), B_t, offs(32, 64))
    # the recipe's options are bools: "no" or 0 would have passed a truth test as the other choice
    with pytest.raises(ValueError, match="wgrad_with_hp must be a bool, got 'no'"):
        training.mxfp8_grouped_mm(A, B_t, offs(32, 64), wgrad_with_hp="no")
    with pytest.raises(ValueError, match="pad_token_groups_for_grouped_mm must be a bool, got 1"):
        training.mxfp8_grouped_mm(A, B_t, offs(32, 64), pad_token_groups_for_grouped_mm=1)
    # padded groups: the caller's offs are checked before padding (the GEMMs see only the padded ends)
    for bad, match in ((offs(64, 32), "non-decreasing"), (offs(32, 100), "at most M"), (offs(-5, 64), "non-decreasing")):
        with pytest.raises(ValueError, match=match):
            training.mxfp8_grouped_mm(A, B_t, bad, pad_token_groups_for_grouped_mm=True)
    # backward: 32x1 blocks may not straddle groups (the error came from the inner wgrad op, naming
    # neither the training op nor the options that lift it). Traced, as on a GPU, nothing is read on
    # the host: a device-side assert (before it, on a GPU, B_t's gradient was silently wrong)
    A.requires_grad_()
    out = training.mxfp8_grouped_mm(A, B_t.requires_grad_(), offs(40, 64))
    with pytest.raises(ValueError, match=r"mxfp8_grouped_mm's backward .* multiple of 32; pass "
                                         r"pad_token_groups_for_grouped_mm=True .* sizes \[40, 24\]"):
        out.sum().backward()
    step = torch.compile(lambda a, b: training.mxfp8_grouped_mm(a, b, offs(40, 64)).sum(), fullgraph=True,
                         backend="aot_eager")
    with pytest.raises(RuntimeError, match="every group size must be a multiple of 32; pass pad_token_groups"):
        step(A, B_t).backward()
    # M off 32: the wgrad's quantize of the token rows named its own x ("x.shape[0] (M, ...)")
    A, B_t = A[:48].detach().requires_grad_(), B_t.detach().requires_grad_()
    out = training.mxfp8_grouped_mm(A, B_t, offs(16, 48))
    with pytest.raises(ValueError, match=r"A.shape\[0\] \(M, the token rows.* = 48 must be a positive multiple of 32"):
        out.sum().backward()


def test_training_op_refuses_before_launching(monkeypatch):
    """On the kernel path a refusal comes before any launch (helper-75): the backward's unaligned
    groups after the dgrad's casts and GEMM had run; under FLYQUANT_BACKEND=flydsl gfx942's K limit
    after the forward's casts (and for N, in the backward, after the whole forward)."""
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    A, W, G, _ = _training_case()
    a, b = A.clone().requires_grad_(), W.transpose(1, 2).requires_grad_()
    out = training.mxfp8_grouped_mm(a, b, offs(8, 40, 96))  # group sizes 8, 32, 56
    with fq.emu.record() as launches, pytest.raises(ValueError, match="every group size must be a multiple of 32"):
        out.backward(G)
    assert launches == []
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    big = 43680  # past GFX942_GROUPED_MM_MAX_K
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16)  # noqa: E731
    for a, b in ((zeros(32, big), zeros(1, big, 32)),  # the forward's K
                 (zeros(32, 32).requires_grad_(), zeros(1, 32, big))):  # the dgrad's K: B_t's N
        with fq.emu.record() as launches, pytest.raises(select.BackendError, match=f"K = {big} > 43648 on gfx942"):
            training.mxfp8_grouped_mm(a, b, offs(32))
        assert launches == []


def _mx_error(x: torch.Tensor, along: int) -> torch.Tensor:
    """e(x) = 2^-4 |x| + 2^-10 amax / 224 per element, blocks of 32 along dim `along` (module doc)."""
    t = x.double().movedim(along, -1)
    amax = t.abs().unflatten(-1, (-1, MX_BLOCK)).amax(-1).repeat_interleave(MX_BLOCK, -1)
    return (2.0**-4 * t.abs() + 2.0**-10 * amax / 224).movedim(-1, along)


def _product_bound(a, ea, b, eb):
    """sum_k e(a)|b| + |a|e(b) + e(a)e(b) for a (R, K) @ b (K, C), and S = sum |a||b|."""
    a, b = a.double().abs(), b.double().abs()
    return ea @ b + a @ eb + ea @ eb, a @ b


def _training_case(m=96, k=64, n=64, ends=(32, 32, 96), seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(m, k, generator=g).to(torch.bfloat16)
    W = (torch.randn(len(ends), n, k, generator=g) * 0.5).to(torch.bfloat16)  # (E, N, K), as torchao stores it
    G = torch.randn(m, n, generator=g).to(torch.bfloat16)
    return A, W, G, offs(*ends)


def _run_training_op(A, B_t, G, ends, mode="rceil", **options):
    a, b = A.clone().requires_grad_(), B_t.detach().clone().requires_grad_()  # clone keeps B_t's strides
    assert b.stride() == B_t.stride()
    out = training.mxfp8_grouped_mm(a, b, ends, scaling_mode=mode, **options)
    out.backward(G)
    return out.detach(), a.grad, b.grad


def test_training_op_vs_bf16_autograd(reference_backend):
    """Forward, dgrad and wgrad (rceil) against the BF16 autograd of the same grouped matmul, each
    element within the MX bound (module docstring)."""
    check_vs_bf16_autograd(lambda t: t)


@pytest.mark.gpu
def test_gpu_training_op_vs_bf16_autograd(monkeypatch):
    """On a real MI300X/MI355X: the op on the device's kernels (its six quantize casts and three
    grouped GEMMs), within the same bound of the BF16 autograd computed on the CPU."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    check_vs_bf16_autograd(lambda t: t.cuda())


def check_vs_bf16_autograd(to_device):
    """The training op on the tensors to_device gives, against the CPU's BF16 autograd."""
    A, W, G, ends = _training_case()
    on = [to_device(t) for t in (A, W.transpose(1, 2), G, ends)]
    out, grad_a, grad_b_t = (t.cpu() for t in _run_training_op(*on))
    A1, B1 = A.clone().requires_grad_(), W.transpose(1, 2).clone().requires_grad_()
    ref_out = torch._grouped_mm(A1, B1, offs=ends)
    ref_out.backward(G)
    k, n = A.shape[1], W.shape[1]
    for g, (lo, hi) in enumerate(groups(ends)):
        a, w, gr = A[lo:hi], W[g], G[lo:hi]
        # forward: a (rows, K) 1x32 along K, w^T (K, N) blocks along K
        bound, s = _product_bound(a, _mx_error(a, 1), w.T, _mx_error(w, 1).T)
        exact = a.double() @ w.double().T
        tol = bound + fp32_bound(exact.abs() + bound, s + bound, k, torch.bfloat16, sides=2)
        assert ((out[lo:hi].double() - ref_out[lo:hi].detach().double()).abs() <= tol).all(), f"forward group {g}"
        # dgrad: gr (rows, N) 1x32 along N, w (N, K) blocks along N
        bound, s = _product_bound(gr, _mx_error(gr, 1), w, _mx_error(w, 0))
        exact = gr.double() @ w.double()
        tol = bound + fp32_bound(exact.abs() + bound, s + bound, n, torch.bfloat16, sides=2)
        assert ((grad_a[lo:hi].double() - A1.grad[lo:hi].double()).abs() <= tol).all(), f"dgrad group {g}"
        # wgrad: a^T (K, rows) and gr (rows, N), both blocks of 32 rows
        if hi > lo:
            bound, s = _product_bound(a.T, _mx_error(a, 0).T, gr, _mx_error(gr, 0))
            exact = a.double().T @ gr.double()
            tol = bound + fp32_bound(exact.abs() + bound, s + bound, hi - lo, torch.bfloat16, sides=2)
            assert ((grad_b_t[g].double() - B1.grad[g].double()).abs() <= tol).all(), f"wgrad group {g}"
        else:
            assert (grad_b_t[g] == 0).all()
    assert grad_a.dtype == A.dtype and grad_b_t.dtype == W.dtype and grad_b_t.shape == (3, k, n)


OPERAND_CASES = [("reference", m, lay, {}) for m in ("rceil", "floor") for lay in ("transposed_view", "contiguous")]
OPERAND_CASES += [("gfx942", "rceil", "transposed_view", {}), ("gfx950", "floor", "contiguous", {})]
# torchao's other recipe options: groups not multiples of 32 (an empty one, rows past the last)
PAD, HP = {"pad_token_groups_for_grouped_mm": True}, {"wgrad_with_hp": True}
OPERAND_CASES += [("reference", "rceil", "transposed_view", PAD), ("reference", "floor", "contiguous", HP),
                  ("gfx950", "rceil", "transposed_view", PAD), ("gfx942", "floor", "transposed_view", PAD),
                  ("gfx950", "rceil", "transposed_view", {**PAD, **HP})]


@pytest.mark.parametrize("where,mode,layout,options", OPERAND_CASES)
def test_training_op_gemm_operands(monkeypatch, where, mode, layout, options):
    """Each GEMM of the op sees exactly the operands the contract names, quantized by the
    reference quantize (1x32 rows of A, of B_t^T, of grad_out, of B_t; 32x1 columns of grad_out
    and A, per group) and multiplied in FP64: fp32_bound. B_t as torchao passes it (the transpose of
    contiguous (E, N, K) weights) and contiguous (E, K, N). On the reference backend, and as the
    selector plans it under the emulator (the quantize casts on flyquant's kernels; the GEMMs on
    whatever is registered). With torchao's options: pad_token_groups_for_grouped_mm quantizes
    each group's 32x1 blocks as if the group were zero-padded to a multiple of 32 (its padded
    recipe); wgrad_with_hp gives B_t's gradient from the unquantized A and grad_out."""
    if where == "reference":
        monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    else:
        monkeypatch.setenv("FLYQUANT_ARCH", where)
    with fq.emu.record() as launches:
        check_gemm_operands(lambda t: t, mode, layout, options)
    kernels = [r.kernel for r in launches]
    # six casts (four with wgrad_with_hp): A, B_t along K, grad_out 1x32, B_t along N, grad_out and A 32x1
    casts = 4 if options.get("wgrad_with_hp") else 6
    assert (kernels == []) if where == "reference" else (len(kernels) >= casts and all(where in k for k in kernels)), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("options", [PAD, HP, {**PAD, **HP}], ids=["padded", "wgrad_with_hp", "both"])
def test_gpu_training_op_options(monkeypatch, options):
    """On a real MI300X/MI355X: torchao's recipe options (the padding on the device, the
    unquantized wgrad by the device's torch._grouped_mm) against the same contract."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    check_gemm_operands(lambda t: t.cuda(), "rceil", "transposed_view", options)


def check_gemm_operands(to_device, mode, layout, options):
    """The training op on the tensors to_device gives (module tests above), every output within
    fp32_bound of the FP64 products of the operands the contract names."""
    A, W, G, ends = _training_case(ends=(5, 5, 77) if options else (0, 64, 96))
    B_t = W.transpose(1, 2) if layout == "transposed_view" else W.transpose(1, 2).contiguous()
    on = [to_device(t) for t in (A, B_t, G, ends)]
    out, grad_a, grad_b_t = (t.cpu() for t in _run_training_op(*on, mode, **options))
    k, n, end = A.shape[1], W.shape[1], int(ends[-1])
    assert (out[end:] == 0).all() and (grad_a[end:] == 0).all()
    qa, sa = reference.mxfp8_quantize(A, -1, mode)
    qw, sw = reference.mxfp8_quantize(W.reshape(-1, k), -1, mode)  # W (E, N, K) along K
    exact, s = grouped64(deq64(qa, sa, -1), deq64(qw, sw, -1).view(W.shape), ends)
    assert_within(out[:end], exact[:end], fp32_bound(exact, s, k, torch.bfloat16)[:end], "forward")
    qg, sg = reference.mxfp8_quantize(G, -1, mode)
    qwt, swt = reference.mxfp8_quantize(W.transpose(1, 2).reshape(-1, n), -1, mode)  # B_t (E, K, N) along N
    exact, s = grouped64(deq64(qg, sg, -1), deq64(qwt, swt, -1).view(B_t.shape), ends)
    assert_within(grad_a[:end], exact[:end], fp32_bound(exact, s, n, torch.bfloat16)[:end], "dgrad")
    for g, (lo, hi) in enumerate(groups(ends)):
        if options.get("wgrad_with_hp"):
            a64, g64 = A[lo:hi].double(), G[lo:hi].double()
        else:  # the group's rows, zero-padded to whole 32x1 blocks
            rows = -(-(hi - lo) // MX_BLOCK) * MX_BLOCK
            a64, g64 = (_deq_columns(torch.nn.functional.pad(t[lo:hi], (0, 0, 0, rows - hi + lo)), mode)
                        for t in (A, G))
        exact, s = a64.T @ g64, a64.T.abs() @ g64.abs()
        assert_within(grad_b_t[g], exact, fp32_bound(exact, s, max(hi - lo, 1), torch.bfloat16), f"wgrad {g}")


def _deq_columns(t, mode):
    """t (R, C), R a multiple of 32 (or 0), quantized 32x1 by the reference and dequantized in FP64."""
    if t.shape[0] == 0:
        return t.double()
    q, sc = reference.mxfp8_quantize(t, 0, mode)
    return deq64(q.t(), sc, -1).t()


@pytest.mark.parametrize("where,pad", [("reference", False), ("reference", True), ("gfx950", False), ("gfx942", True)])
def test_training_op_prequantized_a(monkeypatch, where, pad):
    """A pre-quantized (a_quantized: torchao's MXTensor A, here with -0 elements, which gfx942's
    forward GEMM must read as OCP codes): the forward multiplies exactly those codes (B_t along K,
    row-major scales), dgrad is the usual one, and wgrad_with_hp uses A's dequantized values;
    without wgrad_with_hp it is refused. Tolerances: fp32_bound on the FP64 products."""
    if where == "reference":
        monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    else:
        monkeypatch.setenv("FLYQUANT_ARCH", where)
    A, W, G, ends = _training_case(ends=(20, 20, 77))
    A[::7, ::5] = -0.0
    data, scales = reference.mxfp8_quantize(A, -1, "rceil")
    assert (data.view(torch.uint8) == 0x80).any()
    handle = torch.zeros_like(A).requires_grad_()  # its values are never read
    B_t = W.transpose(1, 2).detach().clone().requires_grad_()
    with pytest.raises(ValueError, match="needs wgrad_with_hp=True"):
        training.mxfp8_grouped_mm(handle, B_t, ends, a_quantized=(data, scales))
    with fq.emu.record() as launches:
        out = training.mxfp8_grouped_mm(handle, B_t, ends, wgrad_with_hp=True, pad_token_groups_for_grouped_mm=pad,
                                        a_quantized=(data, scales))
        out.backward(G)
    kernels = [r.kernel for r in launches]
    assert (kernels == []) if where == "reference" else (len(kernels) >= 3 and all(where in k for k in kernels))
    k, n, end = A.shape[1], W.shape[1], int(ends[-1])
    a64 = deq64(data, scales, -1)
    qw, sw = reference.mxfp8_quantize(W.reshape(-1, k), -1, "rceil")
    exact, s = grouped64(a64, deq64(qw, sw, -1).view(W.shape), ends)
    assert_within(out[:end], exact[:end], fp32_bound(exact, s, k, torch.bfloat16)[:end], "forward")
    assert (out[end:] == 0).all() and (handle.grad[end:] == 0).all() and handle.grad.dtype == A.dtype
    qg, sg = reference.mxfp8_quantize(G, -1, "rceil")
    qwt, swt = reference.mxfp8_quantize(W.transpose(1, 2).reshape(-1, n), -1, "rceil")
    exact, s = grouped64(deq64(qg, sg, -1), deq64(qwt, swt, -1).view(B_t.shape), ends)
    assert_within(handle.grad[:end], exact[:end], fp32_bound(exact, s, n, torch.bfloat16)[:end], "dgrad")
    for g, (lo, hi) in enumerate(groups(ends)):
        exact, s = a64[lo:hi].T @ G[lo:hi].double(), a64[lo:hi].T.abs() @ G[lo:hi].double().abs()
        assert_within(B_t.grad[g], exact, fp32_bound(exact, s, max(hi - lo, 1), torch.bfloat16), f"wgrad {g}")


def test_training_op_rows_past_the_last_group(reference_backend):
    A, W, G, ends = _training_case(m=128, ends=(32, 96))
    A.requires_grad_()
    B_t = W.transpose(1, 2).detach().requires_grad_()
    out = training.mxfp8_grouped_mm(A, B_t, ends, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and (out[96:] == 0).all()
    out.backward(G.float())
    assert (A.grad[96:] == 0).all() and A.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_training_op_wgrad_with_hp_any_a(reference_backend, dtype):
    """wgrad_with_hp with an FP16/FP32 A (the default BF16 out_dtype: torch._grouped_mm's operands
    promote to FP32, its out_dtype must follow) given column-major with M = 33 (its row stride, 33
    elements, is no multiple of 16 bytes): B_t's gradient is A[g]^T @ grad_out[g]; the backward
    raised torch._grouped_mm's errors. A's values are not BF16 values and B_t is FP32, so the
    gradient is held to the FP32 bound: A rounded to BF16 on the way would exceed it."""
    _, W, G, ends = _training_case(m=33, ends=(5, 5, 33))
    A = torch.randn(33, W.shape[2], generator=torch.Generator().manual_seed(9)).to(dtype)
    assert not torch.equal(A.bfloat16().to(dtype), A)
    A = A.t().contiguous().t().requires_grad_()
    B_t = W.float().transpose(1, 2).detach().requires_grad_()
    training.mxfp8_grouped_mm(A, B_t, ends, wgrad_with_hp=True).backward(G)
    assert A.grad.dtype == dtype and B_t.grad.dtype == torch.float32
    for g, (lo, hi) in enumerate(groups(ends)):
        a64, g64 = A[lo:hi].detach().double(), G[lo:hi].double()
        exact, s = a64.T @ g64, a64.T.abs() @ g64.abs()
        assert_within(B_t.grad[g], exact, fp32_bound(exact, s, max(hi - lo, 1), torch.float32), f"wgrad {g}")


@pytest.mark.parametrize("options", [{}, PAD, HP], ids=["default", "padded", "wgrad_with_hp"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_training_op_compiles_fullgraph(reference_backend, backend, options):
    A, W, G, ends = _training_case(ends=(5, 5, 77) if options else (32, 32, 96))
    B_t = W.transpose(1, 2)

    def step(A, B_t):
        return (training.mxfp8_grouped_mm(A, B_t, ends, **options).float() * G.float()).sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        a, b = A.clone().requires_grad_(), B_t.detach().clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        results.append((loss.detach(), a.grad, b.grad))
    for want, got in zip(*results):
        assert torch.equal(got, want)
