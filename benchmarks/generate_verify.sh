#!/usr/bin/env bash
# A random-weight SmolLM2-135M-shaped Hugging Face folder (transformers' LlamaConfig of the
# GGUF's shape, the tokenizer from benchmarks/assets/smollm2_tokenizer), then
# `python -m compile generate --verify` with --mode eager and --mode graphs on it. The text is
# meaningless (random weights); --verify still compares the greedy ids with transformers'
# generate token for token. The 0.5 GB folder is deleted afterwards.
#
#   bash benchmarks/generate_verify.sh OUT_DIR [cuda|cpu]     # cpu: 2 layers, 4 tokens, no Inductor
set -u
cd "$(dirname "$0")/.."
out="${1:?usage: generate_verify.sh OUT_DIR [cuda|cpu]}"
device="${2:-cuda}"
PY="${PYTHON:-python}"
if [ "$device" = cpu ]; then layers=2; tokens=4; extra="--no-inductor"; else layers=30; tokens=32; extra=""; fi
mkdir -p "$out"
model="$out/random_smollm2_135m"
$PY - "$model" benchmarks/assets/smollm2_tokenizer "$layers" <<'EOF' || exit 1
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
status=0
for mode in eager graphs; do
    $PY -m compile generate --model "$model" --device "$device" --mode "$mode" \
        --max-new-tokens "$tokens" --verify --no-progress $extra > "$out/generate_$mode.log" 2>&1
    rc=$?
    echo "generate --mode $mode: exit $rc"
    grep -E "^(prefill|decode|compile|verify: all|verify: MISMATCH)" "$out/generate_$mode.log" \
        | sed "s/^/  [$mode] /"
    [ $rc = 0 ] || status=$rc
done
rm -rf "$model"
exit $status
