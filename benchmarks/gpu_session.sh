#!/usr/bin/env bash
# One call on the GPU machine: the chosen parts, one after another, each logged and timed, into
# a run folder that benchmarks/make_results_page.py turns into that device kind's section of
# benchmarks/RESULTS.md:
#
#   OUT=/tmp/run PARTS="decode profile attention mla gemm" bash benchmarks/gpu_session.sh
#   mkdir -p benchmarks/results/h100 && tar xzf /tmp/run/results.tgz -C benchmarks/results/h100 \
#       && cp /tmp/run/summary.txt benchmarks/results/h100/       # back on this machine
#   python benchmarks/make_results_page.py                    # every folder in benchmarks/results
#
#   OUT=/path PARTS="suite sgl" bash benchmarks/gpu_session.sh        # on the GPU, repo root
#   OUT=/tmp/dry PARTS="decode profile" DRY_RUN=1 PYTHON=.venv/bin/python \
#       bash benchmarks/gpu_session.sh                                # CPU check, tiny shapes
#
# Parts (each under `timeout`; its log is $OUT/<part>.log, its results $OUT/<part>*):
#   suite      pytest -m gpu -v (each failure named as it happens, so a cut run keeps them),
#              one worker per 20 GiB of device memory (SUITE_WORKERS), SUITE_TESTS a part of it
#              (files or node ids; default all): about 320 s at 8 workers on an H200
#   sgl        scripts/run_sgl_kernel_tests.py -n 8 (sgl-kernel's public tests, saved under the
#              git-ignored .peer/)                                         about 200 s
#   decode     bench_model: graphs, dense, graphs_addmm, piecewise at b = 1/8/64, best of 2 rounds,
#              16 layers, context 1024 (tokens/s table and plot, piecewise / graphs ratio)
#                                                                          about 160 s
#   profile    profile_decode.py: the kernels of one graphs decode step, b = 1 and 64 (run it in
#              the same call as `decode`)                                  about 60 s
#   steps      bench_model: extend and mixed steps of 64 and 512 tokens, compiled against graphs
#                                                                          about 150 s
#   mla        bench_attention, the MLA decode row only: default, mla_split and the MLA_CFGS
#              tile sweep                                                  about 90 s
#   kernels_check  pytest -m gpu of the split-KV paths the kernels' table relies on: the
#              FlashMLA kernel's in-kernel split merge (test_flash_mla_gpu.py) and the paged
#              decode split-KV launches (test_triton_gpu.py -k "long_context or
#              replays_bitwise")                                           about 40-75 s
#   kernels    bench_attention --kernels-table: the kernels' one-run table (MLA decode against
#              the matmul ceiling; decode 64x4096 page 16/64 and 8x32768 against SDPA, cuDNN
#              and FlashInfer, each with both split schedules; the eager and in-graph b=1
#              decode call; prefill 8x4096 causal against SDPA, cuDNN, FA2, FlashInfer and
#              Flex); beside it kernels/limits.md, what limits the rows short of their
#              targets: the eager call's host time split into our Python, the Triton launch
#              and the rest, the compiled kernels of prefill and MLA decode (registers,
#              spills, shared memory, blocks per SM, waves), and the host time per 16-layer
#              b=1 decode step in compiled mode (about 100 s of it: the Inductor compile).
#              DRY_RUN: only the limits that run on the CPU (limits_report.py, tiny shapes,
#              Triton's interpreter)                                       about 250-450 s
#   attention  bench_attention --quick --no-sweeps --targeted: the kernels' one-run table, the
#              rows with a target, MLA first (the FlashInfer prefill rows JIT-compile for about
#              90 s each)                                                  several minutes
#   gemm       bench_decode_gemm: the decode step's GEMM shapes under each GEMM choice
#                                                                          about 150 s
#   disagg     bench_disaggregation: a prefill process and a graphs-mode decode process on the
#              one card, KV transfer against prefill ms per request, tokens checked against one
#              engine, NCCL on one card probed (gloo through the host when it refuses)
#                                                                          about 120 s
#   dsa        bench_dsa_decode --models sparse: a DeepSeek-V3.2-shaped model (4 layers, context
#              8192, top-k 2048) decoding in graphs mode at b = 1/8/32, DSA sparse MLA, and
#              the kernels of its b = 1 step (profile_sparse_graphs_b1.md)    about 100 s
#   dsa_dense  the same with dense MLA, in its own process, into the same table (run after dsa)
#                                                                          about 90 s
#   dsa_indexer  bench_dsa_indexer --cases topk paged: the indexer's top-k (decode rows b = 1/8/32
#              at 8192 keys, one program per row) and paged logits against the reference
#              provider and the copy ceiling                                 about 60 s
#   hybrid     bench_hybrid_decode: a Qwen3-Next-shaped hybrid (8 layers, 3 linear per full
#              attention layer) against a dense model of the same size, graphs mode, b = 1/8/32,
#              context 1024 (tokens/s, graph breaks, replays)                about 150 s
#   generate   a random-weight SmolLM2-135M-shaped Hugging Face folder, then `python -m compile
#              generate --verify` in eager and graphs mode                 about 150 s
#
# The parts run in the order given and never side by side: the gpu suite and the sgl-kernel tests
# run together once ran the 139 GiB GPU out of memory. DEADLINE (seconds after the start,
# default 570: the machine's per-command limit is 600) cuts a part that is still running and
# skips the parts after it. Wheels under .whl/ (expecttest, flashinfer-python, apache-tvm-ffi:
# the device README's way of carrying packages) are installed into /tmp/site first.
# $OUT/summary.txt gets each part's exit status (124: cut at its limit) and seconds; the logs and
# results end up in $OUT/results.tgz, with env.txt (device, torch, Triton and Python versions)
# and commands.txt (each part's command line, "part<TAB>command", $OUT spelled out).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the folder that receives the logs}"
PARTS="${PARTS:?set PARTS, e.g. PARTS='suite sgl' (see the header)}"
PY="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"
DEADLINE="${DEADLINE:-570}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
if [ "$DRY_RUN" != 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$DRY_RUN" = 1 ]; then  # CPU: tiny shapes, every part's command line exercised
    DEVICE=cpu; SMALL="--layers 2 --hidden 128 --context 32"; BATCHES="1 4"; TOKENS="16"
else
    DEVICE=cuda; SMALL=""; BATCHES="1 8 64"; TOKENS="64 512"
fi
SUITE_TESTS="${SUITE_TESTS:-}"  # the gpu suite's files or node ids (default: all)
suite_workers() {  # one xdist worker per 20 GiB of device memory (12 on an 80 GB card starved
    # each other of memory and failed the last tests); SUITE_WORKERS overrides
    local gib
    gib=$($PY -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30
                  if torch.cuda.is_available() else 40)" 2>/dev/null || echo 40)
    echo "${SUITE_WORKERS:-$(( gib / 20 > 1 ? gib / 20 : 2 ))}"
}
note() { echo "$*" | tee -a "$SUMMARY"; }
note "gpu_session $(date -u +%FT%TZ) parts: $PARTS; $(git log --oneline -1 2>/dev/null)"
$PY - > "$OUT/env.txt" <<'EOF'
import platform, torch
try:
    import triton
    tri = f"Triton {triton.__version__}"
except ImportError:
    tri = "no Triton"
if torch.cuda.is_available():
    dev = torch.cuda.get_device_name()
elif hasattr(torch, "xpu") and torch.xpu.is_available():
    dev = torch.xpu.get_device_name()
else:
    dev = f"CPU ({platform.processor() or platform.machine()})"
print(f"{dev}, torch {torch.__version__}, {tri}, Python {platform.python_version()}")
EOF
: > "$OUT/commands.txt"

run_part() {  # run_part NAME LIMIT CMD...: timed, logged, status noted; skipped past DEADLINE
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
    shift 2
    if [ "$left" -le 10 ]; then
        note "$name: skipped (deadline)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local command="$*"
    printf '%s\t%s\n' "$name" "${command//$OUT/\$OUT}" >> "$OUT/commands.txt"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    note "$name: exit $? in $((SECONDS - t0)) s (limit $limit s)"
}

for part in $PARTS; do
    case $part in
    suite) run_part suite 420 $PY -m pytest -m gpu -n "$(suite_workers)" -v -p no:cacheprovider \
               -rfE --tb=short --durations=15 $SUITE_TESTS
           grep -cE "\] (FAILED|ERROR) " "$OUT/suite.log" | sed 's/^/suite: failed or errored so far: /' \
               >> "$SUMMARY"
           tail -n 1 "$OUT/suite.log" >> "$SUMMARY" ;;
    sgl) run_part sgl 300 $PY scripts/run_sgl_kernel_tests.py --out "$OUT/sgl" -n 8 ;;
    decode) run_part decode 240 $PY benchmarks/bench_model.py --device $DEVICE $SMALL \
                --modes graphs dense graphs_addmm piecewise --batches $BATCHES --rounds 2 \
                --compile-layers 0 --steps-tokens --out "$OUT/decode" ;;
    profile) run_part profile 150 $PY benchmarks/profile_decode.py --device $DEVICE $SMALL \
                 --batches ${BATCHES%% *} ${BATCHES##* } --out "$OUT/profile" ;;
    steps) run_part steps 200 $PY benchmarks/bench_model.py --device $DEVICE $SMALL \
               --modes compiled graphs --batches 1 --steps-tokens $TOKENS \
               --step-modes compiled graphs --compile-layers 0 --out "$OUT/steps" ;;
    mla) run_part mla 150 $PY benchmarks/bench_attention.py --variant mla_split --only MLA \
             --out "$OUT/mla" ;;
    kernels_check) run_part kernels_check 75 $PY -m pytest -m gpu -q -p no:cacheprovider \
                       tests/ops/test_flash_mla_gpu.py tests/ops/test_triton_gpu.py \
                       -k "long_context or replays_bitwise"
                   tail -n 1 "$OUT/kernels_check.log" >> "$SUMMARY" ;;
    kernels) if [ "$DRY_RUN" = 1 ]; then  # the table is CUDA only; its CPU-able limits
                 TRITON_INTERPRET=1 run_part kernels 300 $PY benchmarks/limits_report.py \
                     --device cpu --context 32 --iters 3 --layers 2 --hidden 128 --steps 3 \
                     --out "$OUT/kernels"; else
                 run_part kernels 540 $PY benchmarks/bench_attention.py --kernels-table \
                     --out "$OUT/kernels"; fi ;;
    attention) run_part attention 540 $PY benchmarks/bench_attention.py --quick --no-sweeps \
                   --targeted --out "$OUT/attention" ;;
    gemm) run_part gemm 240 $PY benchmarks/bench_decode_gemm.py --device $DEVICE \
              $([ "$DRY_RUN" = 1 ] && echo --quick) --out "$OUT/gemm" ;;
    disagg) run_part disagg 170 $PY benchmarks/bench_disaggregation.py --device $DEVICE \
                $([ "$DRY_RUN" = 1 ] && echo --quick --prompt-lens 8 20 --repeats 1 \
                  --new-tokens 3 || echo --probe-nccl) --out "$OUT/disagg" ;;
    dsa|dsa_dense) run_part $part 150 $PY benchmarks/bench_dsa_decode.py --device $DEVICE \
                       $([ "$DRY_RUN" = 1 ] && echo --quick) \
                       --models $([ $part = dsa ] && echo sparse || echo dense) \
                       --profile-batches 1 --out "$OUT/dsa" ;;
    dsa_indexer) run_part dsa_indexer 120 $PY benchmarks/bench_dsa_indexer.py --device $DEVICE \
                     $([ "$DRY_RUN" = 1 ] && echo --quick) --cases topk paged \
                     --out "$OUT/dsa_indexer" ;;
    hybrid) run_part hybrid 180 $PY benchmarks/bench_hybrid_decode.py --device $DEVICE \
                $([ "$DRY_RUN" = 1 ] && echo --quick --no-inductor --dtype float32 --context 16 \
                  || echo --layers 8 --context 1024) --batches ${BATCHES/64/32} \
                --new-tokens 16 --out "$OUT/hybrid" ;;
    generate) run_part generate 200 bash benchmarks/generate_verify.sh "$OUT/generate" $DEVICE ;;
    *) note "$part: unknown part (see the header)" ;;
    esac
done
# The device tool brings back at most 8 files: everything but the summary travels as one archive.
(cd "$OUT" && tar czf results.tgz --exclude results.tgz --exclude summary.txt -- * \
    && find . -mindepth 1 ! -name results.tgz ! -name summary.txt -delete)
echo "--- summary ($SUMMARY)"; cat "$SUMMARY"
