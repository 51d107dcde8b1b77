#!/usr/bin/env bash
# The GPU checks of the kernels in one run, under 8 minutes on an H200: install the project (building the CUDA
# C++ extension), run every `gpu`-marked test (kernels at real shapes, CUDA C++ kernels, CUDA graphs, the engine's
# GPU generate test), run the kernel microbenchmarks, and write a results table.
#
#   OUT=/some/folder bench/gpu_check.sh
#
# Writes into $OUT (at most 8 files): results.md (the summary), kernels.json + kernels.md (benchmark), pytest.log,
# install.log, bench.log, engine.log (engine throughput vs transformers on the GPU), gpu.txt. Each stage has its own time limit, so one stuck stage cannot eat the others'.
# The GPU image has no package registry: the image's own torch/triton stand in for the project's pins (hence
# --no-deps); a package it lacks can ride along as wheels in .whl/ (installed first when present).
set -u -o pipefail
OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
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
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$OUT/install.log" 2>&1 \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
MAX_JOBS=16 timeout 120 $PY -m pip install --no-build-isolation --no-deps -e . >> "$OUT/install.log" 2>&1
install_rc=$?
if ! $PY -c "import kernels._cuda" > /dev/null 2>&1; then  # an editable install may leave the .so in build/
    MAX_JOBS=16 timeout 40 $PY setup.py build_ext --inplace >> "$OUT/install.log" 2>&1
fi
if $PY -c "import kernels._cuda" >> "$OUT/install.log" 2>&1; then cuda_ext="kernels._cuda built"; else cuda_ext="kernels._cuda NOT built (CUDA C++ tests skip)"; fi
note "| install (pip -e ., exit $install_rc) | $cuda_ext | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
timeout 150 $PY -m pytest -m gpu tests/ -q -rs -p no:cacheprovider --continue-on-collection-errors > "$OUT/pytest.log" 2>&1
pytest_rc=$?
note "| pytest -m gpu tests/ (exit $pytest_rc) | $(tail -n 1 "$OUT/pytest.log") | $(( $(elapsed) - stage_start )) |"

stage_start=$(elapsed)
timeout 100 $PY -m bench.kernels --out "$OUT/kernels.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
note "| python -m bench.kernels (exit $bench_rc) | see kernels.md | $(( $(elapsed) - stage_start )) |"
stage_start=$(elapsed)
timeout 60 $PY -m bench.throughput --device cuda --num-prompts 32 --output-len 64 > "$OUT/engine.log" 2>&1
engine_rc=$?
note "| python -m bench.throughput --device cuda (exit $engine_rc) | $(tail -n 1 "$OUT/engine.log") | $(( $(elapsed) - stage_start )) |"
note ""
note "Total $(elapsed) s."
note ""
if [ -f "$OUT/kernels.md" ]; then cat "$OUT/kernels.md" >> "$SUMMARY"; fi
{ echo; echo '```'; cat "$OUT/engine.log"; echo '```'; } >> "$SUMMARY"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest.log" | head -n 60 | sed 's/^/    /' >> "$SUMMARY"
cat "$SUMMARY"
[ "$pytest_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$engine_rc" -eq 0 ]
