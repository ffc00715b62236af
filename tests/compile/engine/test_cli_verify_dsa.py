"""``python -m compile generate --verify`` on a DeepSeek-V3.2 folder whose ``index_topk`` (8) is
below the prompt lengths: the engine's indexer scores fp8 queries and keys, so ``--verify``
compares with ``transformers`` under the same fp8 indexer
(``compile.models.deepseek_v32_reference``) and says so; against plain ``transformers`` (float
scores) the same run mismatches, which is the near-tie drift the fp8 reference removes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("transformers has no DeepseekV32ForCausalLM", allow_module_level=True)
tokenizers = pytest.importorskip("tokenizers")

from compile.__main__ import main  # noqa: E402
from compile.engine import cli_verify  # noqa: E402
from compile.models.deepseek_v32_reference import fp8_round, hadamard  # noqa: E402
from tests.models import test_deepseek_v32_parity as v32  # noqa: E402

INDEX_TOPK, NEW_TOKENS = 8, 16
PROMPTS = ["a", "medium len prompt here"]


def byte_tokenizer():
    """A ``transformers`` fast tokenizer of one token per UTF-8 byte (byte-level BPE, no
    merges; 256 ids), saved with the model so the folder loads offline."""
    from tokenizers import decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)},
                                          merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def v32_folder(tmp_path_factory):
    """A saved tiny random ``deepseek_v32`` (the parity test's, 256-token vocabulary,
    ``index_topk`` 8) with its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_v32")
    v32.make_hf(INDEX_TOPK, vocab_size=256).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def generate_verify(folder: str, capsys) -> tuple[int, str]:
    argv = ["generate", "--model", folder, "--verify", "--no-progress", "--max-new-tokens",
            str(NEW_TOKENS)]
    for p in PROMPTS:
        argv += ["--prompt", p]
    rc = main(argv)
    return rc, capsys.readouterr().out


def test_verify_uses_the_fp8_indexer_reference(v32_folder, capsys):
    rc, out = generate_verify(v32_folder, capsys)
    assert rc == 0 and "verify: all prompts match" in out, out
    assert (f"verify: reference: {cli_verify.FP8_INDEXER_REFERENCE}; ids must be equal"
            in out), out


def test_plain_transformers_reference_mismatches(v32_folder, capsys, monkeypatch):
    """The same run judged against plain transformers (float indexer scores) fails: the fp8
    reference is what makes the check above pass, not a weaker comparison."""
    monkeypatch.setattr(cli_verify, "reference_of", lambda hf_model: (
        cli_verify.PLAIN_REFERENCE, contextlib.nullcontext()))
    rc, out = generate_verify(v32_folder, capsys)
    assert rc == 1 and "verify: MISMATCH" in out, out
    assert "fp8" not in out, out


def test_fp8_round_is_a_rotation_then_row_scaled_e4m3():
    """``fp8_round``: the Sylvester Hadamard matrix is orthogonal up to ``d``; each row of the
    result is within e4m3's half-step (2**-4 relative, or the scale's subnormal step) of the
    float64 rotation of the input, and divided by its scale it is an e4m3 value."""
    d = 16
    h = hadamard(d).double()
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))
    x = torch.randn(5, 3, d, dtype=torch.float64) * torch.logspace(-3, 2, 5)[:, None, None]
    rotated = x @ h / d ** 0.5
    got = fp8_round(x.float()).double()
    scale = rotated.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    assert (got - rotated).abs().le(rotated.abs() * 2.0 ** -4 + scale * 2.0 ** -9 + 1e-6).all()
    values = got / scale  # e4m3 values, up to the float32 rounding of the scale
    e4m3 = values.float().to(torch.float8_e4m3fn).double()
    assert torch.allclose(values, e4m3, rtol=1e-5, atol=0) and values.abs().max() <= 448.0001
    with pytest.raises(ValueError, match="hadamard: d must be a power of two"):
        hadamard(12)
