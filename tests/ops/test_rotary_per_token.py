"""``apply_rotary_emb_per_token`` (the shim's ``sgl_kernel.testing.rotary_embedding.
_apply_rotary_emb``): both pair layouts against a float64 oracle from the rotation formula,
strided rows, argument errors, a fullgraph trace."""

from __future__ import annotations

import pytest
import torch

from xpu_ops.ops.rotary import apply_rotary_emb_per_token


def oracle_rotate(x, cos, sin, neox):
    """float64: pair (a, b) -> (a cos - b sin, b cos + a sin); NeoX pairs i with i + D/2, GPT-J
    pairs 2i with 2i + 1."""
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    half = x.shape[-1] // 2
    idx_a = torch.arange(half) if neox else torch.arange(0, 2 * half, 2)
    idx_b = idx_a + half if neox else idx_a + 1
    out = x.clone()
    a, b = x[..., idx_a], x[..., idx_b]
    out[..., idx_a] = a * cos - b * sin
    out[..., idx_b] = b * cos + a * sin
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_oracle_on_strided_rows(neox, dtype):
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(7, 3, 2, 32, generator=gen).to(dtype)
    x = wide[:, :, 1]                                       # strided [N, H, D]
    angle = torch.rand(7, 16, generator=gen) * 6.3
    out = apply_rotary_emb_per_token(x, angle.cos(), angle.sin(), is_neox_style=neox)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), oracle_rotate(x, angle.cos(), angle.sin(), neox),
                               **tol)
    assert out.dtype == dtype


def test_errors_are_house_errors():
    x = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="_apply_rotary_emb: is_neox_style is not a bool"):
        apply_rotary_emb_per_token(x, torch.ones(4, 4), torch.ones(4, 4), is_neox_style=2)
    with pytest.raises(ValueError, match=r"_apply_rotary_emb: cos has the wrong size in "
                                         r"dimension 0; expected x.shape\[0\]"):
        apply_rotary_emb_per_token(x, torch.ones(3, 4), torch.ones(3, 4), is_neox_style=True)


def test_fullgraph_trace():
    gen = torch.Generator().manual_seed(1)
    x, angle = torch.randn(5, 2, 8, generator=gen), torch.rand(5, 4, generator=gen)
    fn = lambda x, c, s: apply_rotary_emb_per_token(x, c, s, is_neox_style=False)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, angle.cos(), angle.sin()),
                               fn(x, angle.cos(), angle.sin()))
