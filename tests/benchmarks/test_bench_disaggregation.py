"""bench_disaggregation on the CPU: two gloo processes (prefill, decode), a tiny model, eager
modes; every measured request has a row with its transfer and prefill times, the KV bytes are
the model's per-token KV times the prompt, and the greedy tokens equal one engine's. On a GPU
(``gpu``): both processes on the one card, decode in captured graphs."""

import json

import bench_disaggregation
from tests.markers import GPU_DEVICE, requires_gpu_graphs


def test_quick_run_times_each_request_and_checks_tokens(tmp_path, capsys):
    result = bench_disaggregation.main([
        "--device", "cpu", "--quick", "--prompt-lens", "8", "12", "--repeats", "1",
        "--new-tokens", "2", "--page-size", "4", "--decode-page-size", "1",
        "--prefill-mode", "eager", "--decode-mode", "eager", "--out", str(tmp_path)])
    assert result["tokens_equal"] and result["requests_equal"] == [4, 4], result
    assert result["backend"] == "gloo" and result["wire"] == "cpu"
    q = bench_disaggregation.QUICK
    per_token = q["num_hidden_layers"] * 2 * q["num_key_value_heads"] * q["head_dim"] * 4
    assert [(r["prompt_len"], r["bytes"]) for r in result["rows"]] == [
        (8, 8 * per_token), (12, 12 * per_token)]
    assert all(r["prefill_ms"] > 0 and r["transfer_ms"] > 0 and r["pack_ms"] > 0
               for r in result["rows"]), result["rows"]
    assert [t["prompt_len"] for t in result["table"]] == [8, 12]
    saved = json.loads((tmp_path / "disaggregation.json").read_text())
    assert saved["table"] == result["table"]
    md = (tmp_path / "disaggregation.md").read_text()
    assert md.count("\n| 8 | 1 | ") == 1 and "equal to one engine's: yes (4 of 4" in md, md


def test_quick_model_holds_the_default_prompt_lengths():
    """``--quick`` with the default ``--prompt-lens`` (the documented CPU check) fits the tiny
    model's positions: the longest prompt plus the new tokens."""
    args = bench_disaggregation.build_parser().parse_args(["--quick"])
    longest = max(args.prompt_lens) + args.new_tokens
    assert bench_disaggregation.QUICK["max_position_embeddings"] >= longest


def test_merge_flags_a_token_mismatch():
    class Args:
        prompt_lens, repeats, quick = [8], 1, True
        device, dtype, prefill_mode, decode_mode = "cpu", "float32", "eager", "eager"
        page_size, decode_page_size, new_tokens, inductor = 1, 1, 2, False

    pre = {"rows": [{"rid": 0, "prompt_len": 8, "pack_ms": 1.0, "prefill_ms": 2.0},
                    {"rid": 1, "prompt_len": 8, "pack_ms": 1.0, "prefill_ms": 4.0}],
           "errors": {}, "wire": "cpu"}
    dec = {"log": [{"rid": 1, "prompt_len": 8, "bytes": 2**20, "transfer_ms": 3.0}],
           "got": [[1, 2], [3, 4]], "want": [[1, 2], [3, 5]], "errors": {},
           "graphs": {"captures": 0, "replays": 0}, "decode_steps": 2}
    result = bench_disaggregation.merge(Args, [pre, dec], "gloo", "not probed")
    assert not result["tokens_equal"] and result["requests_equal"] == [1, 2]
    assert result["table"] == [dict(prompt_len=8, requests=1, mib=1.0, prefill_ms=4.0,
                                    pack_ms=1.0, transfer_ms=3.0, moved_over_prefill=1.0)]


@requires_gpu_graphs
def test_one_card_prefill_process_and_graphs_decode_process(tmp_path):
    # both processes on the one GPU; the decode engine replays captured decode graphs
    result = bench_disaggregation.main([
        "--device", GPU_DEVICE, "--quick", "--prompt-lens", "16", "40", "--repeats", "1",
        "--new-tokens", "4", "--probe-nccl", "--out", str(tmp_path)])
    assert result["tokens_equal"] and result["requests_equal"] == [4, 4], result
    assert result["graphs"]["captures"] > 0 and result["graphs"]["replays"] > 0, result
    probe = result["nccl_probe"]
    assert result["backend"] == ("nccl" if probe == "ok" else "gloo"), result
    assert result["wire"] == ("cpu" if result["backend"] == "gloo" else f"{GPU_DEVICE}:0")
