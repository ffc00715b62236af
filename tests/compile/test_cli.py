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
                         ("graphs", "decode graphs: none (no capture on this device"),
                         ("full_and_piecewise", "decode graphs: none (no capture on this device")):
        rc, out, texts = generate(mode, capsys)
        assert rc == 0 and "verify: all prompts match" in out, out
        assert texts == eager, (mode, texts, eager)
        # 2 Dynamo graphs (extend, then dynamic decode) x (num_layers + 1 = 3) pieces;
        # graphs mode on the CPU replays the static-buffer step without capture.
        assert marker in out, out
        assert "0 graph breaks" in out, out
        if mode == "full_and_piecewise":  # decode steps took the decode runner's path
            assert re.search(r"[1-9]\d* decode steps ran uncaptured", out), out


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


# User errors in the arguments: one line on stderr naming the flag, the rule and the value,
# exit status 2, and nothing loaded (load_model is replaced by a function that fails the test).
BAD_ARGS = [
    (["generate", "--model", "/no/such/model.gguf"],
     r"generate: error: argument --model: expected 'tiny', 'default', a \.gguf file or a Hugging "
     r"Face model folder, got '/no/such/model\.gguf' \(no such file or folder\)"),
    (["generate", "--model", "{tmp}"],
     r"argument --model: expected .*, got '.*' \(a folder without config\.json\)"),
    (["generate", "--mode", "fast"],
     r"argument --mode: invalid choice: 'fast' \(choose from 'eager', 'compile'"),
    (["generate", "--temperature", "-1"],
     r"argument --temperature: expected a finite number >= 0 \(0 = greedy\), got '-1'"),
    (["generate", "--temperature", "nan"], r"argument --temperature: expected .*, got 'nan'"),
    (["generate", "--page-size", "0"], r"argument --page-size: expected an integer >= 1, got 0"),
    (["generate", "--chunked-prefill-size", "0"],
     r"argument --chunked-prefill-size: expected an integer >= 1, got 0"),
    (["generate", "--max-new-tokens", "0"],
     r"argument --max-new-tokens: expected an integer >= 1, got 0"),
    (["generate", "--max-new-tokens", "-5"],
     r"argument --max-new-tokens: expected an integer >= 1, got -5"),
    (["generate", "--max-new-tokens", "ten"],
     r"argument --max-new-tokens: expected an integer >= 1, got 'ten'"),
    (["generate", "--dtype", "fp8"],
     r"argument --dtype: invalid choice: 'fp8' \(choose from 'float32', 'bfloat16', 'float16'\)"),
    (["generate", "--threads", "-1"], r"argument --threads: expected an integer >= 0, got -1"),
    (["generate", "--prompts-file", "/no/such/prompts.txt"],
     r"argument --prompts-file: expected an existing file, got '/no/such/prompts\.txt'"),
    (["generate", "--model", "tiny", "--verify", "--temperature", "0.7"],
     r"^python -m compile generate: error: argument --verify: compares greedy ids; expected "
     r"--temperature 0, got --temperature 0\.7"),
    (["check", "/no/such/folder"],
     r"^python -m compile check: error: argument model: expected 'tiny', 'default', .*, got "
     r"'/no/such/folder' \(no such file or folder\)"),
    (["check", "tiny", "--page-size", "0"],
     r"argument --page-size: expected an integer >= 1, got 0"),
    (["check", "tiny", "--dtype", "int8"], r"argument --dtype: invalid choice: 'int8'"),
]


@pytest.fixture
def no_loading(monkeypatch):
    import compile.cli_models as cli_models

    def load_model(*args, **kwargs):
        raise AssertionError("an argument error must be reported before the model loads")

    monkeypatch.setattr(cli_models, "load_model", load_model)


@pytest.mark.parametrize("argv, pattern", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_argument_errors_are_one_line_and_status_2(argv, pattern, tmp_path, capsys, no_loading):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    assert re.search(pattern, err[0]), err[0]
    assert err[0].endswith("--help)"), err[0]


def test_unavailable_device_is_an_argument_error(monkeypatch, capsys, no_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert re.fullmatch(r"python -m compile generate: error: argument --device: expected auto or "
                        r"an available device \(cpu.*\), got 'cuda' \(no cuda device in this "
                        r"PyTorch build\) \(see python -m compile generate --help\)\n",
                        capsys.readouterr().err)


def test_internal_errors_keep_their_traceback(monkeypatch):
    """A failure while the command runs is not an argument error: it propagates as is."""
    import compile.cli_models as cli_models

    def broken(*args, **kwargs):
        raise RuntimeError("internal failure while loading")

    monkeypatch.setattr(cli_models, "load_model", broken)
    with pytest.raises(RuntimeError, match="internal failure while loading"):
        main(["generate", "--model", "tiny", "--device", "cpu"])
