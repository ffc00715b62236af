#!/usr/bin/env bash
# One GPU session (< 9 minutes): gpu tests, a modest bench_model table, generate eager vs graphs.
#
#   OUT=/path/to/results bash benchmarks/gpu_session.sh           # on the H200, from the repo root
#   DRY_RUN=1 OUT=/tmp/dry bash benchmarks/gpu_session.sh         # CPU check of part (c) only
#   SKIP_GPU_TESTS=1 ...                                          # parts (b) and (c) only
#   SKIP_BENCH=1 ...                                              # without part (b)
#   MODES="eager piecewise graphs" ...                            # the generate modes of (c)
#
# Parts, each under its own `timeout` (seconds):
#   (a) python -m pytest -m gpu -q                               -> $OUT/gpu_tests.log      120
#   (b) benchmarks/bench_model.py: 4 layers of Llama-3.2-1B width, context 512, decode tokens/s
#       for eager/compiled/piecewise/graphs at batch 1/8/64        -> $OUT/bench_model.{md,json,png}
#                                                                     and $OUT/bench_model.log 150
#   (c) a random-weight SmolLM2-135M-shaped Hugging Face folder (transformers LlamaConfig of the
#       GGUF's shape, tokenizer from benchmarks/assets/smollm2_tokenizer, extracted offline from
#       the GGUF), then `python -m compile generate --verify` with --mode eager and --mode graphs
#                                                                  -> $OUT/generate_{eager,graphs}.log
#                                                                     make 30, eager 45, graphs 150
# $OUT/summary.txt gets each part's exit status (124: timed out) and the tokens/s lines.
# The generated text is meaningless (random weights); --verify still compares greedy ids with
# transformers' generate (on the CPU) token for token.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/*.py import compile, xpu_ops
OUT="${OUT:?set OUT to the folder that receives the logs}"
PY="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
if [ "$DRY_RUN" = 1 ]; then  # CPU: only part (c), 2 layers, 4 tokens
    DEVICE=cpu LAYERS=2 TOKENS=4 MODES="eager graphs" EXTRA="--no-inductor"
else
    DEVICE=cuda LAYERS=30 TOKENS=32 MODES="${MODES:-eager graphs}" EXTRA=""
fi

note() { echo "$*" | tee -a "$SUMMARY"; }
run_part() {  # run_part NAME SECONDS LOG CMD...: timed, logged, status noted
    local name=$1 seconds=$2 log=$3
    shift 3
    local t0=$SECONDS
    timeout -k 10 "$seconds" "$@" > "$log" 2>&1
    local rc=$?
    note "$name: exit $rc in $((SECONDS - t0)) s (limit $seconds s; log $(basename "$log"))"
    return $rc
}

note "gpu_session $(date -u +%FT%TZ) device=$DEVICE $($PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")' 2>&1)"

if [ "$DRY_RUN" != 1 ] && [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
    # (a) the gpu-marked tests (pyproject's addopts says -m 'not gpu'; the later -m wins)
    run_part "a pytest -m gpu" 120 "$OUT/gpu_tests.log" $PY -m pytest -m gpu -q
    tail -n 3 "$OUT/gpu_tests.log" >> "$SUMMARY"
fi
if [ "$DRY_RUN" != 1 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then

    # (b) decode tokens/s per mode; 12 (mode, batch) runs, each compiles a 4-layer model
    run_part "b bench_model" 150 "$OUT/bench_model.log" $PY benchmarks/bench_model.py \
        --device cuda --dtype bfloat16 --layers 4 --context 512 --batches 1 8 64 \
        --warmup 3 --steps 20 --compile-layers 0 --out "$OUT/bench_model"
    grep -E "^\| |tok/s" "$OUT/bench_model.log" >> "$SUMMARY"
fi

# (c) random SmolLM2-135M-shaped folder + generate eager / graphs with --verify
MODEL_DIR="$OUT/random_smollm2_135m"
run_part "c make random model" 30 "$OUT/make_model.log" $PY - "$MODEL_DIR" \
    benchmarks/assets/smollm2_tokenizer "$LAYERS" <<'EOF'
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out, tokenizer_dir, layers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
# SmolLM2-135M-Instruct's shape, as its GGUF's config reads in transformers
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                     eos_token_id=2, hidden_act="silu")
torch.manual_seed(0)
model = LlamaForCausalLM(config)  # Hugging Face init: N(0, 0.02) weights, unit norms
model.save_pretrained(out)
for f in tokenizer_dir.iterdir():
    shutil.copy(f, out / f.name)
print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters to {out}")
EOF
if [ $? = 0 ]; then
    for mode in $MODES; do
        limit=45; [ "$mode" != eager ] && limit=150
        run_part "c generate --mode $mode" $limit "$OUT/generate_$mode.log" \
            $PY -m compile generate --model "$MODEL_DIR" --device "$DEVICE" --mode "$mode" \
            --max-new-tokens "$TOKENS" --verify --no-progress $EXTRA
        grep -E "^(prefill|decode|compile|verify: all|verify: MISMATCH)" \
            "$OUT/generate_$mode.log" | sed "s/^/  [$mode] /" >> "$SUMMARY"
    done
fi
rm -rf "$MODEL_DIR"  # 0.5 GB of random weights: not worth bringing back
echo "--- summary ($SUMMARY)"; cat "$SUMMARY"
