"""flyquant.layouts against torchao's to_blocked, aiter's e8m0_shuffle and aiter's A16W4 shuffles
(byte-identical), plus the e8m0_shuffle permutation written out here as index arithmetic."""

import pytest
import torch

from flyquant import layouts as L

import oracles

U8 = torch.uint8
E8M0 = torch.float8_e8m0fnu


def _random_bytes(shape, seed, dtype=U8):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(U8).view(dtype)


# (rows, cols): exact 128 x 4 tiles, ragged in both dims, a single partial tile
TCGEN05_SHAPES = [(256, 8), (300, 5), (7, 3), (128, 36)]


@pytest.mark.parametrize("shape", TCGEN05_SHAPES)
def test_tcgen05_blocked_is_torchaos_to_blocked(shape):
    tao = oracles.torchao()
    s = _random_bytes(shape, seed=1, dtype=E8M0)
    out = L.tcgen05_blocked(s)
    assert out.dtype == E8M0 and out.dim() == 1
    assert torch.equal(out.view(U8), tao.to_blocked(s.view(U8)))


def test_tcgen05_col_groups_is_torchaos_k_groups():
    tao = oracles.torchao()
    s = _random_bytes((200, 24), seed=2)  # 3 groups of 8, 4 and 12 columns plus an empty one
    ends = torch.tensor([8, 12, 12, 24])
    out = L.tcgen05_blocked_col_groups(s, ends)
    ref, _ = tao.moe.torch_to_blocked_2d_K_groups(s, ends)
    ref = ref.flatten()
    assert torch.equal(out, ref[: out.numel()]) and (ref[out.numel():] == 0).all()
    with pytest.raises(ValueError, match="multiple of 4"):
        L.tcgen05_blocked_col_groups(s, torch.tensor([6, 24]))


def _mfma_index(r: int, c: int, cols: int) -> int:
    """Destination of scale (r, c) in e8m0_shuffle, derived from the MFMA lane mapping: within the
    32 x 8 tile (r // 32, c // 8), lane = (c % 4) * 16 + r % 16 reads one dword, whose byte is
    2 * (c % 8 // 4) + (r % 32 // 16). Tiles are stored row of tiles major, 256 bytes each."""
    tile = (r // 32) * (cols // 8) + c // 8
    lane = (c % 4) * 16 + r % 16
    byte = 2 * ((c % 8) // 4) + (r % 32) // 16
    return tile * 256 + lane * 4 + byte


def test_mfma_shuffle_permutation_written_out():
    rows, cols = 300, 5  # pads to 512 x 8
    s = _random_bytes((rows, cols), seed=3)
    out = L.mfma_shuffle_scales(s).flatten()
    assert out.numel() == 512 * 8
    expected = torch.zeros(512 * 8, dtype=U8)
    for r in range(rows):
        for c in range(cols):
            expected[_mfma_index(r, c, 8)] = s[r, c]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("shape", [(256, 8), (512, 16), (300, 5)])
def test_mfma_shuffle_is_aiters_e8m0_shuffle(shape):
    aiter = oracles.aiter_fp4_utils()
    s = _random_bytes(shape, seed=4, dtype=E8M0)
    rows, cols = shape
    padded = torch.zeros((rows + 255) // 256 * 256, (cols + 7) // 8 * 8, dtype=U8)
    padded[:rows, :cols] = s.view(U8)  # aiter's padding is uninitialised memory; ours is zero
    out = L.mfma_shuffle_scales(s)
    assert out.dtype == E8M0
    assert torch.equal(out.view(U8), aiter.e8m0_shuffle(padded.view(E8M0)).view(U8))
    back = L.mfma_unshuffle_scales(out)
    assert back.dtype == E8M0 and torch.equal(back.view(U8), padded)


def test_scale_layouts_take_one_2d_matrix_of_scale_bytes():
    """bf16 (256, 4) scales were shuffled as their 8 bytes a row and came back bf16 garbage; a 1D
    or 3D tensor (the 3D quantize's per-expert mfma scales) failed unpacking its shape."""
    for fn, name in ((L.tcgen05_blocked, "scales"), (L.mfma_shuffle_scales, "scales"),
                     (L.mfma_unshuffle_scales, "shuffled")):
        with pytest.raises(TypeError, match=f"{name} must have dtype in \\(float8_e8m0fnu, uint8\\), got torch.bfloat16"):
            fn(torch.zeros(256, 4, dtype=torch.bfloat16))
        for shape in ((2048,), (1, 256, 8)):
            with pytest.raises(ValueError, match=f"{name} must be 2D, got {len(shape)}D"):
                fn(torch.zeros(shape, dtype=E8M0))


# (E, N, K/2, nlane, gate_up): the GPT-OSS-like tile case, nlane 32, gate/up interleave, one tile
WEIGHT_CASES = [(2, 64, 128, 16, False), (2, 64, 128, 32, False), (3, 64, 64, 16, True), (1, 64, 32, 32, True)]


@pytest.mark.parametrize("experts,n,k_half,nlane,gate_up", WEIGHT_CASES)
def test_shuffle_weight_a16w4_is_aiters(experts, n, k_half, nlane, gate_up):
    aiter = oracles.aiter_shuffle()
    w = _random_bytes((experts, n, k_half), seed=5)
    out = L.shuffle_weight_a16w4(w, nlane, gate_up)
    assert torch.equal(out, aiter.shuffle_weight_a16w4(w, nlane, gate_up))
    assert torch.equal(L.unshuffle_weight_a16w4(out, nlane, gate_up), w)
    fp4 = w.view(torch.float4_e2m1fn_x2)
    assert L.shuffle_weight_a16w4(fp4, nlane, gate_up).dtype == torch.float4_e2m1fn_x2


@pytest.mark.parametrize("gate_up", [False, True])
def test_shuffle_scale_a16w4_is_aiters(gate_up):
    aiter = oracles.aiter_shuffle()
    experts, n, kb = 3, 64, 16  # N: 2 tiles of 32 rows; K = 512: 2 tiles of 8 scales
    s = _random_bytes((experts * n, kb), seed=6, dtype=E8M0)
    out = L.shuffle_scale_a16w4(s, experts, gate_up)
    assert out.shape == s.shape and out.dtype == E8M0
    assert torch.equal(out.view(U8), aiter.shuffle_scale_a16w4(s, experts, gate_up).view(U8))
    out3 = L.shuffle_scale_a16w4(s.view(experts, n, kb), experts, gate_up)  # the 3D form
    assert out3.shape == (experts, n, kb) and torch.equal(out3.view(U8).reshape(-1, kb), out.view(U8))
    assert torch.equal(L.unshuffle_scale_a16w4(out, experts, gate_up).view(U8), s.view(U8))
    assert torch.equal(L.unshuffle_scale_a16w4(out3, experts, gate_up).view(U8), s.view(U8).view(experts, n, kb))


@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (2, 32, 64)])
def test_shuffle_weight_a4w4_is_aiters(shape):
    """aiter's shuffle_weight(x, layout=(16, 16)) (gemm_a4w4's B layout) on packed FP4 bytes: one
    tile, several tiles both ways, a leading batch dim; float4_e2m1fn_x2 kept."""
    aiter = oracles.aiter_shuffle()
    x = _random_bytes(shape, seed=7)
    out = L.shuffle_weight_a4w4(x)
    assert out.shape == x.shape and torch.equal(out, aiter.shuffle_weight(x, layout=(16, 16)))
    assert not torch.equal(out, x)
    assert torch.equal(L.unshuffle_weight_a4w4(out), x)
    fp4 = L.shuffle_weight_a4w4(x.view(torch.float4_e2m1fn_x2))
    assert fp4.dtype == torch.float4_e2m1fn_x2 and torch.equal(fp4.view(U8), out)
    with pytest.raises(ValueError, match=r"x.shape\[-2\] \(M, for the a4w4 shuffle\) = 24 must be a positive multiple of 16"):
        L.shuffle_weight_a4w4(torch.zeros(24, 32, dtype=U8))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(K/2 packed bytes, for the a4w4 shuffle\) = 48 must be a positive multiple of 32"):
        L.shuffle_weight_a4w4(torch.zeros(16, 48, dtype=U8))


def test_shuffle_errors_name_the_constraint():
    with pytest.raises(ValueError, match=r"shuffled.shape\[1\] \(cols, padded for the MFMA scale layout\) = 5"):
        L.mfma_unshuffle_scales(torch.zeros(256, 5, dtype=E8M0))
    s = torch.zeros(2 * 48, 8, dtype=E8M0)  # N = 48
    with pytest.raises(ValueError, match=r"N \(rows per expert\) = 48 must be a positive multiple of 32"):
        L.shuffle_scale_a16w4(s, 2)
    with pytest.raises(ValueError, match="K = 32 \\* s.shape\\[-1\\] = 128 must be a positive multiple of 256"):
        L.shuffle_scale_a16w4(torch.zeros(64, 4, dtype=E8M0), 2)
    with pytest.raises(ValueError, match="multiple of experts"):
        L.shuffle_scale_a16w4(torch.zeros(96, 8, dtype=E8M0), 5)
    with pytest.raises(ValueError, match="must equal s.shape\\[0\\]"):
        L.shuffle_scale_a16w4(torch.zeros(2, 32, 8, dtype=E8M0), 3)
    with pytest.raises(TypeError, match="s must have dtype"):
        L.shuffle_scale_a16w4(torch.zeros(64, 8), 2)
    # experts 2.0 or True (here 2D and 3D scales of one expert) failed in view() naming no argument
    for scales, experts in ((torch.zeros(64, 8, dtype=E8M0), 2.0), (torch.zeros(32, 8, dtype=E8M0), True),
                            (torch.zeros(1, 32, 8, dtype=E8M0), True)):
        for fn in (L.shuffle_scale_a16w4, L.unshuffle_scale_a16w4):
            with pytest.raises(ValueError, match="experts must be an int, got"):
                fn(scales, experts)
    # nlane=16.0 failed in view(), nlane=True ran as 1 lane (then refused K for 64 lanes along K)
    for nlane in (16.0, True, 3):
        for fn in (L.shuffle_weight_a16w4, L.unshuffle_weight_a16w4):
            with pytest.raises(ValueError, match=r"nlane must divide the wave size 64 \(an int\)"):
                fn(torch.zeros(1, 32, 128, dtype=U8), nlane)
    # gate_up="no" (truthy) gave the gate/up layout with no error
    w, s = torch.zeros(1, 64, 128, dtype=U8), torch.zeros(1, 64, 8, dtype=E8M0)
    for fn, args in ((L.shuffle_weight_a16w4, (w, 16)), (L.unshuffle_weight_a16w4, (w, 16)),
                     (L.shuffle_scale_a16w4, (s, 1)), (L.unshuffle_scale_a16w4, (s, 1))):
        for gate_up in ("no", 1, None):
            with pytest.raises(ValueError, match="gate_up must be a bool, got"):
                fn(*args, gate_up)
    with pytest.raises(ValueError, match=r"w.shape\[1\] \(N, rows per expert\) = 40"):
        L.shuffle_weight_a16w4(torch.zeros(1, 40, 64, dtype=U8))
    with pytest.raises(ValueError, match=r"w.shape\[1\] \(N = gate \+ up, rows per expert\) = 48 must be a positive multiple of 32"):
        L.shuffle_weight_a16w4(torch.zeros(1, 48, 64, dtype=U8), gate_up=True)
    with pytest.raises(ValueError, match=r"w.shape\[2\] \(K/2 packed bytes.*= 48 must be a positive multiple of 64"):
        L.shuffle_weight_a16w4(torch.zeros(1, 32, 48, dtype=U8))
    with pytest.raises(ValueError, match="nlane must divide"):
        L.shuffle_weight_a16w4(torch.zeros(1, 48, 64, dtype=U8), nlane=24)
    with pytest.raises(ValueError, match="3D"):
        L.shuffle_weight_a16w4(torch.zeros(32, 64, dtype=U8))
