"""``python -m compile`` on the tiny random model: every ``generate`` mode gives eager's greedy
ids (and ``transformers``'), ``check`` counts breaks and pieces, ``bench`` forwards its options.

Compiled modes run with ``--no-inductor`` (Dynamo's eager backend): tracing, the piecewise split,
the decode graph runner's static buffers and metadata refill all run, without minutes of
Inductor on the 2-core CI machine.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from compile.__main__ import main  # noqa: E402
from compile.cli_check import check_model  # noqa: E402
from compile.cli_models import tiny_hf_model  # noqa: E402
from compile.models import from_hf  # noqa: E402

PROMPTS = ["Hello there", "abc"]
NEW_TOKENS = 10


def generate(mode: str, capsys) -> tuple[int, str, list[str]]:
    """(exit status, stdout, generated text per prompt) of ``generate --model tiny``."""
    argv = ["generate", "--model", "tiny", "--mode", mode, "--verify", "--no-progress",
            "--no-inductor", "--max-new-tokens", str(NEW_TOKENS), "--page-size", "4"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    rc = main(argv)
    out = capsys.readouterr().out
    texts = re.findall(r"--- prompt \d+: .*\n(.*)\n", out)
    return rc, out, texts


def test_generate_piecewise_and_graphs_equal_eager(capsys):
    rc, out, eager = generate("eager", capsys)
    assert rc == 0 and "verify: all prompts match" in out, out
    assert len(eager) == len(PROMPTS)
    for mode, marker in (("piecewise", "piecewise: 6 pieces around 4 attention calls"),
                         ("graphs", "decode graphs: 0 captured"),
                         ("full_and_piecewise", "decode graphs: 0 captured")):
        rc, out, texts = generate(mode, capsys)
        assert rc == 0 and "verify: all prompts match" in out, out
        assert texts == eager, (mode, texts, eager)
        # 2 Dynamo graphs (extend, then dynamic decode) x (num_layers + 1 = 3) pieces;
        # graphs mode on the CPU replays the static-buffer step without capture.
        assert marker in out, out
        assert "0 graph breaks" in out, out
        if mode == "full_and_piecewise":  # decode steps took the decode runner's path
            assert re.search(r"decode graphs: 0 captured, [1-9]\d* replays", out), out


def test_verify_fails_on_a_wrong_model(capsys, monkeypatch):
    import compile.models as models
    real = models.from_hf

    def perturbed(hf_model, **kw):
        model = real(hf_model, **kw)
        with torch.no_grad():
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        return model

    monkeypatch.setattr(models, "from_hf", perturbed)
    rc, out, _ = generate("eager", capsys)
    assert rc == 1 and "verify: MISMATCH" in out, out


def test_check_tiny_reports_no_breaks_and_layers_plus_one_pieces(capsys):
    rc = main(["check", "tiny"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "graph breaks: 0" in out, out
    assert "3 pieces around 2 attention calls" in out, out  # num_layers + 1 pieces, 2 layers


def test_check_counts_an_injected_graph_break():
    model = from_hf(tiny_hf_model())
    layer = model.model.layers[1]
    forward = layer.forward

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return forward(*args, **kwargs)

    layer.forward = breaking
    result = check_model(model)
    assert result.graph_breaks >= 1 and not result.ok, result


@pytest.mark.parametrize("option", ["--page-size", "--max-new-tokens", "--chunked-prefill-size"])
def test_sizes_below_one_are_rejected_before_loading(option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", option, "0"])
    assert exit_info.value.code == 2
    assert f"argument {option}: expected an integer >= 1, got 0" in capsys.readouterr().err
