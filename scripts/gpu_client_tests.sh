#!/usr/bin/env bash
# The clients' own tests on the GPU through the shim. Run from the repository root on the GPU machine,
# $OUT set, the xpu-ops wheels already on PYTHONPATH, pytest-xdist installed, and the ignored
# .peer/ carried (run(..., carry=[".peer"]); 2.9 MB: sgl-kernel-xpu tests + sgl-kernel's newest).
# PART=1..11, each under 540 s: runner lanes in parallel on the one GPU (17 workers in all, one
# CPU thread each: OMP_NUM_THREADS=1, the tests' CPU references and Triton compiles fill the 16
# cores), each lane's jobs one after another, each job stopped at its budget with its counts kept.
# Every job of both runners is in exactly one part (tests/test_client_runners.py).
# Plan: worker-seconds per test on an H100 from part 1 of the former plan (sgl-kernel
# test_flash_attention.py 4.3, test_flashmla.py 5.5, xpu test_flash_mla_decode.py about 3.5 once
# its 162 MLA kernel variants are compiled; xpu test_flash_attention.py not yet measured, taken as
# 3.0), test counts from `--collect`; a lane's estimate is its jobs' worker-seconds / workers +
# 10 s a job. Jobs: fa = xpu flash_attention_<i>of32 (369 tests, ~1,100 w-s), so = sgl
# flash_switches_off_<i>of12 (256, ~1,100), flash_<i>of4 (252, ~1,080), flashmla_<i>of6 (107,
# ~590, either file), flash_mla_decode_<i>of6 (192, ~670).
#   part  lanes (workers: jobs)                                          est. s (longest lane)
#   1-2   6: fa x2 | 6: fa x2 | 5: flash_mla_decode x3                   430
#   3-4   6: fa x2 | 6: fa x2 | 5: xpu flashmla x3                       390
#   5-6   6: fa x2 | 6: fa x2 | 5: sgl flashmla x3                       390
#   7     6: fa x2 | 6: fa x2 | 5: flash_mla_prefill x2, flash_attn_sparse_1of2    420
#   8     6: fa x2 | 6: fa x2 | 3: flash_attn_sparse_2of2, FA4 x2, merges, store |
#         2: sgl merge                                                   390
#   9     6: sgl flash x2 | 5: sgl flash x2 | 6: so x2                   450
#   10    6: so x2 | 6: so x2 | 5: so x2                                 450
#   11    6: so x2 | 6: so x2 | 3: rotary, fp8 logits x2, hadamard, topk x2,
#         flash_mla_sparse_fwd, flash_mla_with_kvcache | 2: GDN x3, causal_conv1d   430
#   Whole run: 11 parts, about 11 x 9 = 100 device minutes (4 sessions of 3 parts). The per-test
#   seconds of each run are in its *.jsonl ("seconds"): re-plan from
#   `python scripts/client_test_times.py <results folders>` (worker-seconds per job and file).
# The two test_flashmla.py files never run side by side (one flashmla lane per part): their
# test_flash_mla_fp8 cases (b = 128, up to ~40k keys, a float32 reference copy of the cache) take
# up to ~30 GB each.
# Expected skips: test_flash_attention_4.py skips every test below compute capability 10 (its
# own gate: FA4 needs Blackwell), so on H100/H200 it reports skips only; test_hadamard.py needs
# scipy (an import error of the file if the image lacks it).
# Results: $OUT/<lane>/{sgl_kernel_xpu_tests,sgl_kernel_tests}.{md,json} and per-job logs.
set -u
PART=${PART:-1}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 | tee -a "$OUT/env.txt"
python -c "import torch, triton, xdist; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"

XPU=scripts/run_sgl_kernel_xpu_tests.py
SGL=scripts/run_sgl_kernel_tests.py
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
lane() {   # lane NAME RUNNER WORKERS BUDGET JOBS
  timeout -k 10 525 python "$2" -n "$3" --budget "$4" --total-budget 505 --jobs "$5" \
    --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  echo "lane $1 exit $?"
}
fa() { local s=""; for i in "$@"; do s="$s,flash_attention_${i}of32"; done; echo "${s#,}"; }
so() { local s=""; for i in "$@"; do s="$s,flash_switches_off_${i}of12"; done; echo "${s#,}"; }

case "$PART" in
1) lane xpu_a $XPU 6 300 "$(fa 1 2)" & lane xpu_b $XPU 6 300 "$(fa 3 4)" &
   lane xpu_c $XPU 5 220 flash_mla_decode_1of6,flash_mla_decode_2of6,flash_mla_decode_3of6 & ;;
2) lane xpu_a $XPU 6 300 "$(fa 5 6)" & lane xpu_b $XPU 6 300 "$(fa 7 8)" &
   lane xpu_c $XPU 5 220 flash_mla_decode_4of6,flash_mla_decode_5of6,flash_mla_decode_6of6 & ;;
3) lane xpu_a $XPU 6 300 "$(fa 9 10)" & lane xpu_b $XPU 6 300 "$(fa 11 12)" &
   lane xpu_c $XPU 5 220 flashmla_1of6,flashmla_2of6,flashmla_3of6 & ;;
4) lane xpu_a $XPU 6 300 "$(fa 13 14)" & lane xpu_b $XPU 6 300 "$(fa 15 16)" &
   lane xpu_c $XPU 5 220 flashmla_4of6,flashmla_5of6,flashmla_6of6 & ;;
5) lane xpu_a $XPU 6 300 "$(fa 17 18)" & lane xpu_b $XPU 6 300 "$(fa 19 20)" &
   lane sgl_c $SGL 5 220 flashmla_1of6,flashmla_2of6,flashmla_3of6 & ;;
6) lane xpu_a $XPU 6 300 "$(fa 21 22)" & lane xpu_b $XPU 6 300 "$(fa 23 24)" &
   lane sgl_c $SGL 5 220 flashmla_4of6,flashmla_5of6,flashmla_6of6 & ;;
7) lane xpu_a $XPU 6 300 "$(fa 25 26)" & lane xpu_b $XPU 6 300 "$(fa 27 28)" &
   lane xpu_c $XPU 5 220 flash_mla_prefill_1of2,flash_mla_prefill_2of2,flash_attn_sparse_1of2 & ;;
8) lane xpu_a $XPU 6 300 "$(fa 29 30)" & lane xpu_b $XPU 6 300 "$(fa 31 32)" &
   lane xpu_c $XPU 3 300 flash_attn_sparse_2of2,flash_attention_4_1of2,flash_attention_4_2of2,merge_state,merge_state_v2,store_cache_xpu &
   lane sgl_d $SGL 2 150 merge & ;;
9) lane sgl_a $SGL 6 300 flash_1of4,flash_2of4 & lane sgl_b $SGL 5 300 flash_3of4,flash_4of4 &
   lane sgl_c $SGL 6 300 "$(so 1 2)" & ;;
10) lane sgl_a $SGL 6 300 "$(so 3 4)" & lane sgl_b $SGL 6 300 "$(so 5 6)" &
    lane sgl_c $SGL 5 300 "$(so 7 8)" & ;;
11) lane sgl_a $SGL 6 300 "$(so 9 10)" & lane sgl_b $SGL 6 300 "$(so 11 12)" &
    lane xpu_c $XPU 3 150 rotary_embedding,fp8_mqa_logits,fp8_paged_mqa_logits,hadamard,topk_transform_1of2,topk_transform_2of2,flash_mla_sparse_fwd,flash_mla_with_kvcache &
    lane xpu_d $XPU 2 150 gdn_attention,causal_conv1d,gdn_attention_workspace,gdn_attention_wrapper & ;;
*) echo "PART must be 1..11"; exit 2 ;;
esac
wait
# Compact report: each lane's job statuses, totals, and every row with a failure or error.
for f in "$OUT"/*.log; do grep -E "^\[sgl_kernel" "$f" | sed "s|^|$(basename "$f" .log): |"; done
for f in "$OUT"/*/sgl_kernel*_tests.md; do
  echo "== $f"; grep -E "^\| total" "$f"
  awk -F'|' 'NR > 4 && ($5 + 0 > 0 || $6 + 0 > 0) {print}' "$f" | head -30
done
grep -h -E '"message"' "$OUT"/*/*.jsonl 2>/dev/null | head -20 | cut -c1-400
cd "$OUT" && tar czf client_logs.tgz */*.log */*.jsonl */*.md */*.json 2>/dev/null; ls "$OUT"
