"""fp8 matmuls (eyas.kernels.fp8): each product against its fp32 value, and a whole TTT forward and
backward in fp8 against the same in full precision. torch._scaled_mm runs on CPU, so these
are the real fp8 kernels' numerics, not a simulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_ttt import grads, make_draft, packed_batch, tiny_cfg

from eyas.kernels import fp8
from eyas.kernels.fp8 import Fp8Matrix
from eyas.kernels.swiglu import SwiGLUDown
from eyas.draft.ttt import ttt_forward


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.detach().flatten().double(), b.detach().flatten().double(),
                                     dim=0))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_quantize_uses_the_format_range_and_round_trips():
    x = torch.randn(37, 64) * 5
    for dtype, bits in ((fp8.E4M3, 3), (fp8.E5M2, 2)):
        x8, s, x8_t = fp8.quantize(x, dtype)
        assert x8_t is None  # no transposed copy unless asked for
        assert x8.dtype == dtype and s.dtype == torch.float32 and s.dim() == 0
        assert float(x8.float().abs().max()) == torch.finfo(dtype).max  # amax maps to the top
        back = x8.float() * s
        # round to nearest with `bits` mantissa bits: relative error <= 2**-(bits+1) for normals
        big = x.abs() > float(s) * torch.finfo(dtype).tiny * 4
        assert float(((back - x).abs() / x.abs())[big].max()) <= 2 ** -(bits + 1) + 1e-6
    zeros8, s, _ = fp8.quantize(torch.zeros(4, 16))
    assert float(s) > 0 and not zeros8.float().any()  # no division by zero


def test_quantize_with_a_bound_or_only_transposed():
    """bound: the scale comes from the given bound on |x|, not from x's maximum (the loss
    gradient's entries lie in [-1, 1]); row_major=False: only the transposed copy."""
    x = torch.rand(37, 32) - 0.5  # |x| <= 0.5 < the bound
    x8, s, x8_t = fp8.quantize(x, fp8.E5M2, transposed=True, bound=1.0)
    fmax = torch.finfo(fp8.E5M2).max
    assert float(s) == torch.tensor(1 / fmax, dtype=torch.float32).item()
    assert float(x8.float().abs().max()) <= fmax / 2  # the bound, not the maximum, maps to the top
    assert torch.equal(x8.float(), (x / s).to(fp8.E5M2).float())
    assert x8_t.shape == (32, 48) and torch.equal(x8_t[:, :37].float(), x8.t().float())
    assert not x8_t[:, 37:].float().any()  # padding rows are zeros
    none, s2, only_t = fp8.quantize(x, fp8.E5M2, transposed=True, row_major=False)
    full8, s3, full_t = fp8.quantize(x, fp8.E5M2, transposed=True)
    assert none is None and float(s2) == float(s3) and torch.equal(only_t.float(), full_t.float())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(37, 64), (3000, 4096), (4096, 14336)])
def test_triton_quantize_matches_the_portable_code_bit_for_bit(shape):
    """On CUDA quantize runs two Triton kernels (eyas.kernels.fp8_kernels); the values, scale and
    padded transposed copy are those of the portable code (eager torch) exactly."""
    from eyas.kernels import fp8_kernels

    torch.manual_seed(shape[0])
    x = (torch.randn(*shape, device="cuda") * 3).bfloat16()
    x[0, 1] = 40.0  # one outlier sets the scale
    for dtype in (fp8.E4M3, fp8.E5M2):
        fmax = torch.finfo(dtype).max
        for bound in (None, 64.0):
            y, s, y_t = fp8_kernels.quantize(x, fmax, dtype, 16, True, True, bound)
            ref_s = fp8._scale(x, fmax) if bound is None else \
                torch.full((), bound / fmax, dtype=torch.float32, device="cuda")
            ref_y, ref_t = fp8._cast.__wrapped__(x, ref_s, fmax, dtype, True)
            assert torch.equal(s, ref_s)
            assert torch.equal(y.view(torch.uint8), ref_y.view(torch.uint8))
            assert torch.equal(y_t.view(torch.uint8), ref_t.view(torch.uint8))
        none, _, t_only = fp8_kernels.quantize(x, fmax, dtype, 16, False, True, None)
        _, ref_t = fp8._cast.__wrapped__(x, fp8._scale(x, fmax), fmax, dtype, True)
        assert none is None and torch.equal(t_only.view(torch.uint8), ref_t.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(37, 128), (3000, 2 * 4096), (4100, 2 * 14336)])
def test_triton_swiglu_quantize_matches_quantizing_the_product(shape):
    """quantize_swiglu on CUDA computes silu(gate) * up inside the Triton passes: the same
    scale and fp8 values as quantizing the product the torch code writes out, up to the
    product's last bit (sigmoid implementations differ); a given scale is used as is."""
    from eyas.kernels import fused

    torch.manual_seed(shape[0])
    gate_up = (torch.randn(*shape, device="cuda") * 2).bfloat16()
    gate_up[1, 3] = 30.0  # an outlier sets the scale
    product = fused._swiglu.__wrapped__(gate_up)
    y, s, y_t = fp8.quantize_swiglu(gate_up, transposed=True)
    ref_y, ref_s, ref_t = fp8.quantize(product, transposed=True)
    torch.testing.assert_close(s, ref_s, rtol=1e-2, atol=0)
    # one fp8 step at most: the products agree to bf16 rounding
    torch.testing.assert_close(y.float() * s, ref_y.float() * ref_s, rtol=0.13, atol=2 * float(s))
    torch.testing.assert_close(y_t.float(), ref_t.float(), rtol=0.13, atol=2.0)
    assert y_t.shape == (shape[1] // 2, shape[0] + (-shape[0] % 16))
    none, s2, t_only = fp8.quantize_swiglu(gate_up, transposed=True, row_major=False, scale=s)
    assert none is None and torch.equal(s2, s) and torch.equal(t_only.view(torch.uint8),
                                                                y_t.view(torch.uint8))


@pytest.mark.parametrize("rows", [37, 64])  # the weight gradient pads 37 rows to 48
def test_linear_forward_and_gradients_close_to_fp32(rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 64, requires_grad=True)
    w = (torch.randn(48, 64) * 0.1).requires_grad_()
    grad = torch.randn(rows, 48)
    y = fp8.linear(x, w, Fp8Matrix.of(w.detach()))
    y.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref)
    y_ref.backward(grad)
    assert not torch.equal(y, y_ref)  # it really ran in fp8
    assert rel_err(y, y_ref) < 0.06 and cosine(y, y_ref) > 0.998
    assert rel_err(x.grad, x_ref.grad) < 0.12 and cosine(x.grad, x_ref.grad) > 0.99
    assert rel_err(w.grad, w_ref.grad) < 0.12 and cosine(w.grad, w_ref.grad) > 0.99


def test_unaligned_weights_stay_in_full_precision():
    assert Fp8Matrix.of(torch.randn(30, 64)) is None
    x, w = torch.randn(5, 64), torch.randn(30, 64)
    torch.testing.assert_close(fp8.linear(x, w, None), F.linear(x, w))


def test_swiglu_down_in_fp8_close_to_fp32():
    torch.manual_seed(1)
    gate_up = torch.randn(21, 128, requires_grad=True)
    w_down = (torch.randn(32, 64) * 0.1).requires_grad_()
    grad = torch.randn(21, 32)
    SwiGLUDown.apply(gate_up, w_down, Fp8Matrix.of(w_down.detach())).backward(grad)
    g_ref, w_ref = gate_up.detach().clone().requires_grad_(), w_down.detach().clone().requires_grad_()
    gate, up = g_ref.chunk(2, -1)
    (F.silu(gate) * up @ w_ref.t()).backward(grad)
    assert cosine(gate_up.grad, g_ref.grad) > 0.99 and cosine(w_down.grad, w_ref.grad) > 0.99


@pytest.mark.parametrize("frozen,layers", [(True, 1), (False, 1), (True, 2)])
def test_ttt_in_fp8_tracks_full_precision(frozen, layers):
    """A whole TTT-5 forward and backward with every draft matmul in fp8: the loss within 2%
    of fp32, each parameter's gradient pointing the same way (cosine > 0.97); for a 2-layer
    draft too (layer 1's q/k/v read the hidden state alone, from one fp8 matrix, where layer
    0's are split into embedding and hidden columns)."""
    cfg = tiny_cfg(hidden_size=64, target_hidden_size=64, head_dim=16, intermediate_size=128,
                   vocab_size=80, draft_vocab_size=48, num_hidden_layers=layers)
    draft = make_draft(cfg)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.3
    draft.init_lm_head_from_target(lm_head, freeze=frozen)
    batch = packed_batch(cfg, [[20, 9, 30], [59]], 64, seed=3)
    ref = ttt_forward(draft, batch, lm_head, steps=5)
    ref_grads = grads(draft, ref.loss)
    out = ttt_forward(draft, batch, lm_head, steps=5, fp8=True)
    got_grads = grads(draft, out.loss)
    assert out.loss.item() != ref.loss.item()
    assert abs(out.loss.item() / ref.loss.item() - 1) < 0.02
    assert out.step_count.tolist() == ref.step_count.tolist()
    assert set(got_grads) == set(ref_grads)
    assert ("lm_head.weight" in got_grads) == (not frozen)
    assert ("layers.1.self_attn.q_proj.weight" in got_grads) == (layers == 2)
    for name, g in ref_grads.items():
        assert cosine(got_grads[name], g) > 0.97, name


def test_train_refuses_fp8_on_a_gpu_without_fp8_units(monkeypatch):
    """The compute-capability threshold: an A100 (8.0) is refused with the fix, an L4 (8.9)
    and an H100 (9.0) pass."""
    from eyas.errors import EyasError
    from eyas.draft.processes import check_fp8

    for capability, ok in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        if ok:
            check_fp8(torch.device("cuda", 0))
        else:
            with pytest.raises(EyasError, match="--precision fp8 needs fp8 matrix units.*"
                                                "cuda:0 has none. Use --precision bf16"):
                check_fp8(torch.device("cuda", 0))
