"""``python -m compile`` on the tiny random model: every ``generate`` mode gives eager's greedy
ids (and ``transformers``'), ``check`` counts breaks and pieces, ``bench`` forwards its options.

Compiled modes run with ``--no-inductor`` (Dynamo's eager backend): tracing, the piecewise split,
the decode graph runner's static buffers and metadata refill all run, without minutes of
Inductor on the 2-core CI machine.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from compile.__main__ import main  # noqa: E402
from compile.engine.cli_check import check_model  # noqa: E402
from compile.engine.cli_models import tiny_hf_model  # noqa: E402
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


def decode_lines(out: str) -> tuple[int, int, int, int, int, float]:
    """(decode tokens, warm-up tokens, warm-up steps, steady tokens, steady steps, steady
    tokens/s) from the report."""
    total = int(re.search(r"^decode: (\d+) tokens", out, re.M)[1])
    warm = re.search(r"^decode warm-up: (\d+) tokens in [\d.]+ s \((\d+) steps: the first 2 "
                     r"of each batch size\)$", out, re.M)
    steady = re.search(r"^decode steady state: (\d+) tokens in ([\d.]+) s = ([\d.]+) tokens/s "
                       r"\((\d+) steps\)$", out, re.M)
    assert warm and steady, out
    return (total, int(warm[1]), int(warm[2]), int(steady[1]), int(steady[4]),
            float(steady[3]))


def test_generate_piecewise_and_graphs_equal_eager(capsys):
    rc, out, eager = generate("eager", capsys)
    assert rc == 0 and "verify: all prompts match" in out, out
    total, warm, warm_steps, steady, steady_steps, _ = decode_lines(out)
    assert warm + steady == total and warm_steps >= 2 and steady_steps >= 1, out
    assert len(eager) == len(PROMPTS)
    for mode, marker in (("piecewise",
                          "piecewise: 6 pieces around 4 attention calls over 2 graphs"),
                         ("graphs", "full graphs: none (no capture on this device")):
        rc, out, texts = generate(mode, capsys)
        assert rc == 0 and "verify: all prompts match" in out, out
        assert texts == eager, (mode, texts, eager)
        # 2 Dynamo graphs (extend, then dynamic decode) x (num_layers + 1 = 3) pieces;
        # graphs mode on the CPU replays the static-buffer step without capture.
        assert marker in out, out
        assert "0 graph breaks" in out, out
        if mode == "graphs":  # decode steps took the runner's path
            assert re.search(r"[1-9]\d* decode steps ran uncaptured", out), out
            assert "piecewise: 6 pieces around 4 attention calls" in out, out


def test_full_and_piecewise_is_an_alias_of_graphs():
    from compile.__main__ import build_parser, make_forward
    from compile.graphs.graph_runner import GraphRunner
    from compile.graphs.piecewise import PiecewiseModel
    from tests.compile.compile_helpers import tiny_model
    args = build_parser().parse_args(["generate", "--mode", "full_and_piecewise"])
    forward = make_forward(tiny_model(num_layers=1), args.mode, inductor=False)
    assert isinstance(forward, GraphRunner) and isinstance(forward.forward, PiecewiseModel)


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_says_its_reference_is_float32(dtype, capsys, monkeypatch):
    """--verify compares against float32 transformers whatever --dtype is: under a 16-bit
    dtype its output and --help say so and a far token still fails (the logit gap, 5, is over
    the tolerance); the float32 check stays exact (any id differs: 1)."""
    from compile.engine import cli_verify
    monkeypatch.setattr(cli_verify, "hf_generate", lambda m, ids, n, stops: [[1, 2, 3], [4, 5]])
    monkeypatch.setattr(cli_verify, "logit_gap", lambda m, prefix, want, got: 5.0)
    note = "verify: reference: float32 transformers; under --dtype"
    assert cli_verify.verify(None, [[0], [0]], [[1, 2, 3], [4, 5]], 3, [], dtype)
    out = capsys.readouterr().out
    assert "verify: all prompts match" in out and (note in out) == (dtype != "float32"), out
    assert not cli_verify.verify(None, [[0], [0]], [[1, 2, 3], [4, 6]], 3, [], dtype)
    out = capsys.readouterr().out
    assert "verify: prompt 1: MISMATCH (first difference at token 1" in out, out
    assert (f"{note} {dtype} ids must be equal up to" in out) == (dtype != "float32"), out
    gen = " ".join(_help(capsys, "generate").split())
    assert "transformers' generate (in float32 whatever --dtype is)" in gen, gen


def test_check_tiny_reports_no_breaks_and_layers_plus_one_pieces(capsys):
    rc = main(["check", "tiny"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "graph breaks: 0" in out, out
    assert "3 pieces around 2 attention calls" in out, out  # num_layers + 1 pieces, 2 layers


@pytest.mark.parametrize("argv", [["tiny"], ["--model", "tiny"],
                                  ["--page-size", "4", "--model", "tiny"],
                                  ["--model", "tiny", "default"]])
def test_check_takes_the_model_as_generate_spells_it(argv):
    """``check --model MODEL`` (generate's flag) names the model like the positional."""
    from compile.__main__ import build_parser

    assert build_parser().parse_args(["check", *argv]).model == "tiny"


def test_check_without_a_model_checks_the_default_one():
    # as generate does: no model named means the default SmolLM2 GGUF (parsed only, not loaded)
    from compile.__main__ import build_parser
    args = build_parser().parse_args(["check"])
    assert args.model == "default" and args.func.__name__ == "cmd_check"


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
     r"generate: error: argument --model: expected 'tiny', 'default', 'gemma3', a \.gguf file or a "
     r"Hugging Face model folder, got '/no/such/model\.gguf' \(no such file or folder\)"),
    (["generate", "--model", "{tmp}"],
     r"argument --model: expected .*, got '.*' \(a folder without config\.json\)"),
    (["generate", "--mode", "fast"],
     r"argument --mode: invalid choice: 'fast' \(choose from 'eager', 'compile'"),
    (["generate", "--temperature", "-1"],
     r"argument --temperature: expected a finite number >= 0 \(0 = greedy\), got '-1'"),
    (["generate", "--temperature", "nan"], r"argument --temperature: expected .*, got 'nan'"),
    (["generate", "--page-size", "0"],
     r"argument --page-size: expected an integer in \[1, 4096\] .*got 0"),
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
    (["generate", "--threads", "-1"],
     r"argument --threads: expected an integer in \[0, \d+\] .*, got -1"),
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
    (["check", "--model", "/no/such/folder"],
     r"^python -m compile check: error: argument --model: expected 'tiny', .*, got "
     r"'/no/such/folder' \(no such file or folder\)"),
    (["check", "tiny", "--model", "tiny"],
     r"argument --model: names the model a second time; expected MODEL or --model MODEL, got "
     r"'tiny' and 'tiny'"),
    (["check", "--model", "tiny", "tiny"], r"argument --model: names the model a second time"),
    # Prompts: empty or blank text, an empty, blank or non-UTF-8 file (files made in {tmp} by
    # the test); before the fix these ran, a blank file silently with the built-in prompts.
    (["generate", "--model", "tiny", "--prompt", ""],
     r"argument --prompt: expected a prompt with non-blank text, got ''"),
    (["generate", "--model", "tiny", "--prompt", " \t "],
     r"argument --prompt: expected a prompt with non-blank text, got ' \\t '"),
    (["generate", "--model", "tiny", "--prompts-file", "{tmp}/empty.txt"],
     r"argument --prompts-file: expected a file with one prompt per line, got '.*empty\.txt' "
     r"\(no non-blank line\)"),
    (["generate", "--model", "tiny", "--prompts-file", "{tmp}/blank.txt"],
     r"argument --prompts-file: expected .*, got '.*blank\.txt' \(no non-blank line\)"),
    (["generate", "--model", "tiny", "--prompts-file", "{tmp}/latin1.txt"],
     r"argument --prompts-file: expected a readable UTF-8 file of prompts, got '.*latin1\.txt' "
     r"\(not UTF-8 text\)"),
    # A .gguf that is not GGUF: one line, not a 27-line traceback from transformers.
    (["generate", "--model", "{tmp}/fake.gguf"],
     r"argument --model: expected .*, got '.*fake\.gguf' \(not a GGUF file: it does not start "
     r"with the GGUF magic bytes\)"),
    (["check", "{tmp}/fake.gguf"], r"argument model: .*\(not a GGUF file"),
    # bench's own options: choices and ranges, one line under bench's name (were tracebacks).
    (["bench", "--modes", "eager", "compile"],
     r"^python -m compile bench: error: argument --modes: invalid choice: 'compile' \(choose "
     r"from 'eager', 'compiled', 'piecewise', 'graphs', 'graphs_compiled', 'graphs_addmm', "
     r"'dense'\)"),
    (["bench", "--dtype", "fp32"],
     r"^python -m compile bench: error: argument --dtype: invalid choice: 'fp32' \(choose from "
     r"'float32', 'bfloat16', 'float16'\)"),
    (["bench", "--steps", "0"], r"bench: error: argument --steps: expected an integer >= 1, got 0"),
    (["bench", "--batches", "1", "-8"],
     r"bench: error: argument --batches: expected an integer >= 1, got -8"),
    (["bench", "--hidden", "48"],
     r"bench: error: argument --hidden: expected 0 or a multiple of 64, got 48"),
    (["bench", "--device", "cpu", "--context", "8192"],
     r"bench: error: argument --context: expected at most 8191 .*, got 8192"),
    (["bench", "--no-such-flag"], r"bench: error: unrecognized arguments: --no-such-flag"),
    # decode-engine options without --disaggregation were ignored; --tp beside "both" was found
    # only inside the spawned processes (two lines from two processes)
    (["generate", "--model", "tiny", "--decode-page-size", "4"],
     r"argument --decode-page-size: sets the decode engine of a disaggregated run; expected "
     r"--disaggregation prefill\|decode\|both beside it, got --decode-page-size 4 alone"),
    (["generate", "--model", "tiny", "--decode-mode", "graphs"],
     r"argument --decode-mode: .*got --decode-mode graphs alone"),
    (["generate", "--model", "tiny", "--disaggregation", "both", "--tp", "2"],
     r"argument --disaggregation: expected --tp 1 --dcp 1 beside it, got --tp 2 --dcp 1"),
    # an unknown flag points at the subcommand's help, which lists its options
    (["generate", "--no-such-flag"],
     r"^python -m compile generate: error: unrecognized arguments: --no-such-flag \(see python "
     r"-m compile generate --help\)"),
]


@pytest.fixture
def no_loading(monkeypatch):
    import compile.engine.cli_models as cli_models

    def load_model(*args, **kwargs):
        raise AssertionError("an argument error must be reported before the model loads")

    monkeypatch.setattr(cli_models, "load_model", load_model)


@pytest.mark.parametrize("argv, pattern", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_argument_errors_are_one_line_and_status_2(argv, pattern, tmp_path, capsys, no_loading):
    for name, data in (("empty.txt", b""), ("blank.txt", b"\n  \n\t\r\n"),
                       ("latin1.txt", "caf\u00e9\n".encode("latin-1")),
                       ("fake.gguf", b"GGML but not GGUF")):
        (tmp_path / name).write_bytes(data)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    assert re.search(pattern, err[0]), err[0]
    assert err[0].endswith("--help)"), err[0]


@pytest.mark.parametrize("built, why", [
    (False, r"no cuda device in this PyTorch build"),
    # PyPI's CUDA build on a machine without a GPU: the build is not the reason
    (True, r"this PyTorch build supports cuda but finds no cuda device")])
def test_unavailable_device_is_an_argument_error(built, why, monkeypatch, capsys, no_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert re.fullmatch(r"python -m compile generate: error: argument --device: expected auto or "
                        rf"an available device \(cpu.*\), got 'cuda' \({why}\) \(see python -m "
                        r"compile generate --help\)\n", capsys.readouterr().err)


def test_internal_errors_keep_their_traceback(monkeypatch):
    """A failure while the command runs is not an argument error: it propagates as is."""
    import compile.engine.cli_models as cli_models

    def broken(*args, **kwargs):
        raise RuntimeError("internal failure while loading")

    monkeypatch.setattr(cli_models, "load_model", broken)
    with pytest.raises(RuntimeError, match="internal failure while loading"):
        main(["generate", "--model", "tiny", "--device", "cpu"])


def _one_line_exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured
    # status lines ("[generate] loading ...") may precede an error found while loading
    err = [line for line in captured.err.splitlines() if not line.startswith(f"[{argv[0]}] ")]
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    return err[0]


def test_a_corrupt_gguf_is_a_one_line_error(tmp_path, capsys):
    """The magic is right, the rest is not: transformers' reader fails while loading."""
    path = tmp_path / "truncated.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 10)
    line = _one_line_exit_2(["generate", "--model", str(path)], capsys)
    assert re.fullmatch(r"python -m compile generate: error: argument --model: expected a model "
                        r"that transformers loads and this zoo supports, got '.*truncated\.gguf' "
                        r"\(struct\.error: .*\) \(see python -m compile generate --help\)",
                        line), line


def test_a_config_transformers_rejects_is_a_one_line_error(tmp_path, capsys):
    """transformers' config validation raises huggingface_hub's StrictDataclassError, which is
    not a ValueError: it still becomes the one-line --model error, not a traceback."""
    config = {"model_type": "qwen3_next", "num_hidden_layers": 4,
              "layer_types": ["linear_attention", "full_attention"]}  # 2 types for 4 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    for argv in (["generate", "--model", str(tmp_path)], ["check", str(tmp_path)]):
        line = _one_line_exit_2(argv, capsys)
        assert re.fullmatch(rf"python -m compile {argv[0]}: error: argument (--)?model: expected a "
                            r"model that transformers loads and this zoo supports, got '.*' "
                            r"\(huggingface_hub\.errors\.StrictDataclassClassValidationError: "
                            r".*layer_types.*\) \(see python -m compile \w+ --help\)", line), line


def test_prompt_longer_than_the_models_positions_is_a_one_line_error(capsys):
    # tiny: max_position_embeddings = 1024; the byte tokenizer gives one token per character
    line = _one_line_exit_2(["generate", "--model", "tiny", "--prompt", "x" * 20,
                             "--max-new-tokens", "1005", "--no-progress"], capsys)
    assert re.search(r"argument --max-new-tokens: prompt 0 is 20 tokens \+ --max-new-tokens "
                     r"1005 = 1025; expected at most the model's max_position_embeddings=1024, "
                     r"got 1025", line), line


@pytest.mark.parametrize("config", [{"max_position_embeddings": 64},
                                    {"text_config": {"max_position_embeddings": 64}}])
def test_max_new_tokens_past_a_known_limit_fails_before_the_model_loads(config, tmp_path,
                                                                        capsys, no_loading):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    (tmp_path / "tokenizer.json").write_text("{}")  # present: the folder passes the parse
    for model, limit in (("tiny", 1024), (str(tmp_path), 64)):
        line = _one_line_exit_2(["generate", "--model", model, "--max-new-tokens",
                                 str(limit)], capsys)
        assert re.fullmatch(rf"python -m compile generate: error: argument --max-new-tokens: a "
                            rf"prompt takes at least 1 of the model's max_position_embeddings="
                            rf"{limit} positions; expected at most {limit - 1}, got {limit} "
                            rf"\(see python -m compile generate --help\)", line), line


def test_prompts_file_lines_are_the_prompts(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n  first prompt\r\n\n\tsecond\n", encoding="utf-8")
    rc = main(["generate", "--model", "tiny", "--prompts-file", str(path), "--prompt", "zero",
               "--max-new-tokens", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.findall(r"--- prompt \d+: (.*)", out) == ["'zero'", "'  first prompt'",
                                                        "'\\tsecond'"], out


def test_bench_runs_a_smoke_table(tmp_path, capsys):
    rc = main(["bench", "--device", "cpu", "--dtype", "float32", "--layers", "1", "--hidden",
               "64", "--batches", "1", "2", "--modes", "eager", "--warmup", "0", "--steps", "1",
               "--context", "8", "--compile-layers", "0", "--out", str(tmp_path / "bench")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"b=1 eager: [\d.]+ tok/s", out) and re.search(r"b=2 eager: ", out), out
    assert (tmp_path / "bench.md").is_file(), sorted(tmp_path.iterdir())


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_texts_state_the_real_defaults(capsys):
    top = _help(capsys)
    assert "``" not in top and "generate" in top and "check" in top, top
    gen = " ".join(_help(capsys, "generate").split())   # argparse wraps lines
    assert "(default: None)" not in gen, gen            # --prompt/--prompts-file/--model
    assert gen.count("the 4 built-in prompts") == 2, gen
    # --mode compile is one torch.compile of the whole model (compile.graphs.compiled_model)
    assert "compile: a plain torch.compile of the whole model" in gen, gen
    assert "per layer kind" not in gen, gen


@pytest.mark.parametrize("provider, pattern", [
    ("bogus", r"'bogus' is not a provider; expected one of"),
    ("triton", r"XPU_OPS_PROVIDER: expected a provider that runs store_kv_cache on cpu, got "
               r"'triton' \(Triton compiles for GPUs only")])
def test_a_provider_that_cannot_run_is_a_one_line_error(provider, pattern, xpu_env, capsys,
                                                        no_loading):
    xpu_env("TRITON_INTERPRET", None)
    xpu_env("XPU_OPS_PROVIDER", provider)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("flag", [False, True])
def test_enable_deterministic_inference_reaches_the_backend(flag, capsys):
    from xpu_ops.testing import recorded_op_calls
    argv = ["generate", "--model", "tiny", "--verify", "--no-progress", "--max-new-tokens",
            "3", "--page-size", "4", "--prompt", "Hello there"]
    with recorded_op_calls("flash_attn_with_kvcache") as seen:
        rc = main(argv + ["--enable-deterministic-inference"] * flag)
    calls = [c["num_splits"] for c in seen]
    out = capsys.readouterr().out
    assert rc == 0 and "verify: all prompts match" in out, out
    assert ("deterministic inference)" in out) is flag, out
    assert calls and set(calls) == {1 if flag else 0}, calls


def test_bench_help_lists_bench_models_options(capsys):
    # bench's errors say "see python -m compile bench --help": that help shows the options
    for flag in ("--help", "-h", "--help-bench"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", flag])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and "--batches" in out and "--layers" in out, out


def test_make_forward_names_an_unknown_mode():
    from compile.engine.forwards import MODES, make_forward
    with pytest.raises(ValueError, match=r"make_forward: mode is unknown; expected one of "
                                         + ", ".join(MODES) + r", got 'graph'\."):
        make_forward(None, "graph")
