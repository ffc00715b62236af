#!/usr/bin/env bash
# The clients' own tests on the GPU through the shim. Run from the repository root on the GPU machine,
# $OUT set, the xpu-ops wheels already on PYTHONPATH, pytest-xdist installed, and the ignored
# .peer/ carried (run(..., carry=[".peer"]); 2.9 MB: sgl-kernel-xpu tests + sgl-kernel's newest).
# Each PART stays under 540 s: three runner lanes in parallel on the one GPU (16 workers in all),
# each lane's jobs one after another, each job stopped at its budget with its counts kept.
#   PART=1 (default): never-run sgl-kernel-xpu jobs (rotary, DSA indexer, top-k, MLA decode,
#          flashmla, sparse, FA4) + sgl-kernel's newest merge and flash shards 1-3/4, and a
#          fourth, small lane (2 workers, 18 in all): the fused GDN layer (test_gdn_attention*.py,
#          three jobs, 86 tests) and the channel-first causal conv1d (760 tests; 2 min on 2 CPU
#          cores on the reference provider).
#   PART=2: sgl-kernel's newest flash shard 4/4 and test_flashmla.py, flash_mla_prefill, and 4
#          of the 24 sgl-kernel-xpu test_flash_attention.py shards (1, 5, 9, 17).
# The two test_flashmla.py files never run side by side: their test_flash_mla_fp8 cases
# (b = 128, up to ~40k keys, a float32 reference copy of the cache) take up to ~30 GB each.
#   PART=3: sgl-kernel's switches-off copy (paged KV + softcap on) + xpu flash shards 13, 21,
#          and a small lane (2 workers, 18 in all) of sgl-kernel-xpu's merge, store and
#          FlashMLA-interface files (merge_state, merge_state_v2, store_cache_xpu,
#          flash_mla_sparse_fwd, flash_mla_with_kvcache).
# Every job of run_sgl_kernel_xpu_tests.py is in exactly one PART (tests/test_client_runners.py).
#   PART=4, 5, 6: the other 18 sgl-kernel-xpu flash_attention shards, 6 a part.
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
lane() {   # lane NAME RUNNER WORKERS BUDGET JOBS
  timeout -k 10 525 python "$2" -n "$3" --budget "$4" --total-budget 505 --jobs "$5" \
    --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  echo "lane $1 exit $?"
}
fa() { local s=""; for i in "$@"; do s="$s,flash_attention_${i}of24"; done; echo "${s#,}"; }

case "$PART" in
1)
  lane xpu_a $XPU 6 200 rotary_embedding,fp8_mqa_logits,fp8_paged_mqa_logits,hadamard,topk_transform_1of2,topk_transform_2of2,flash_mla_decode_1of3,flash_mla_decode_2of3,flash_mla_decode_3of3 &
  lane xpu_b $XPU 4 200 flashmla_1of3,flashmla_2of3,flashmla_3of3,flash_attn_sparse_1of2,flash_attn_sparse_2of2,flash_attention_4_1of2,flash_attention_4_2of2 &
  lane sgl $SGL 5 150 merge,flash_1of4,flash_2of4,flash_3of4 &
  lane xpu_c $XPU 2 150 gdn_attention,causal_conv1d,gdn_attention_workspace,gdn_attention_wrapper &
  ;;
2)
  lane sgl $SGL 4 200 flash_4of4,flashmla_1of3,flashmla_2of3,flashmla_3of3 &
  lane xpu_a $XPU 6 250 "$(fa 1 9)" &
  lane xpu_b $XPU 5 250 "flash_mla_prefill_1of2,flash_mla_prefill_2of2,$(fa 5 17)" &
  ;;
3)
  lane sgl_a $SGL 6 250 flash_switches_off_1of4,flash_switches_off_2of4 &
  lane sgl_b $SGL 5 250 flash_switches_off_3of4,flash_switches_off_4of4 &
  lane xpu_a $XPU 5 250 "$(fa 13 21)" &
  lane xpu_d $XPU 2 100 merge_state,merge_state_v2,store_cache_xpu,flash_mla_sparse_fwd,flash_mla_with_kvcache &
  ;;
4) lane xpu_a $XPU 6 250 "$(fa 2 3)" & lane xpu_b $XPU 5 250 "$(fa 4 6)" &
   lane xpu_c $XPU 5 250 "$(fa 7 8)" & ;;
5) lane xpu_a $XPU 6 250 "$(fa 10 11)" & lane xpu_b $XPU 5 250 "$(fa 12 14)" &
   lane xpu_c $XPU 5 250 "$(fa 15 16)" & ;;
6) lane xpu_a $XPU 6 250 "$(fa 18 19)" & lane xpu_b $XPU 5 250 "$(fa 20 22)" &
   lane xpu_c $XPU 5 250 "$(fa 23 24)" & ;;
*) echo "PART must be 1..6"; exit 2 ;;
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
