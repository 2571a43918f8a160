#!/usr/bin/env bash
# Every `gpu`-marked test and the GPU benchmarks in one run: what to do when a GPU machine is
# lent. Each part has its own time limit and log, and a failed part does not stop the others;
# the exit code is non-zero if any part failed.
#
#   make gpu-check                       # a machine with a registry: installs .[gpu], then this
#   bash bench/gpu_check.sh              # a machine without one: uses .gpu/ (make gpu-bundle)
#
# Logs and JSON go to $OUT (default runs/gpu-check). PYTHON picks the interpreter.
#
# Expected time on an H200 (the parts' times of the 2026-11-28 run, docs/gpu/): env ~10 s, tier
# ~1 min, profile ~2 min, tests ~3 min with 6 workers (FlashInfer JIT-compiles each kernel
# variant on first use, 80-120 s a prefill module, inside that), tests_alone ~20 s, gpu_step ~3
# min (four backends: flashinfer+graphs+overlap added in session 40), gpu_step_8b ~2 min,
# spec and fp8_kv ~1 min each (not yet run there), sim_model + sim_profile ~2 min: ~14 min in all (the gpu
# tests added on 2026-11-30 after that day's run, tests/engine/test_models_gpu.py,
# test_tp_one_device.py and the async_scheduling cases of test_overlap.py, not yet timed there), each part capped by its own limit below. A
# device command may run 10 minutes at most, so split it over two commands on the same warm
# machine (FlashInfer's JIT cache stays there), e.g. PARTS="env gpu_step gpu_step_8b" then
# PARTS="tests tests_alone"; the parts already recorded in docs/gpu/ (tier, profile,
# sim_profile) can be left out when nothing under them changed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled UCX_MODULES='^ib' PYTHONUNBUFFERED=1
export FLASHINFER_JIT_VERBOSE=${FLASHINFER_JIT_VERBOSE:-0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -d .gpu ]; then
    site=${GPU_SITE:-/tmp/pdserve-gpu-site}
    mkdir -p "$site"
    for t in .gpu/*.tar.xz; do tar -xJf "$t" -C "$site"; done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/*.whl \
        || { echo "gpu-check: installing .gpu/*.whl failed"; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# -P: the checkout's own pdserve/ folder must not shadow the installed package
PYP=("$PY" -P)
status=0
# PARTS picks which parts run, in their order below (default: all)
PARTS=" ${PARTS:-env tier profile tests tests_alone gpu_step gpu_step_8b spec fp8_kv sim_profile} "
part() {  # part NAME SECONDS CMD...: one part, its log in $OUT/NAME.log
    local name=$1 secs=$2; shift 2
    [[ "$PARTS" == *" $name "* ]] || return 0
    local t0=$SECONDS
    echo "== gpu-check: $name (limit ${secs} s)"
    timeout -k 10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$OUT/$name.log"
    echo "== gpu-check: $name rc=$rc in $((SECONDS - t0)) s"
    [ $rc = 0 ] || status=1
}
part env 120 "${PYP[@]}" -c "
import shutil, subprocess
print('nvcc', shutil.which('nvcc'), subprocess.run(['nvcc', '--version'], capture_output=True, text=True).stdout.strip().splitlines()[-1:] if shutil.which('nvcc') else '')
import torch, importlib
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.mem_get_info())
for m in ('flashinfer', 'nixl_cu13._api', 'nixl_cu12._api', 'pdserve.engine', 'mistral_common'):
    try:
        mod = importlib.import_module(m); print('import', m, 'ok', getattr(mod, '__version__', ''))
    except Exception as e:
        print('import', m, 'FAILED', type(e).__name__, e)
"
# The second KV tier on the device: token-exact loads from pinned host memory, then its load
# bandwidth against the PCIe floor (bench/kv_tier_gpu.py)
[[ "$PARTS" == *" tier "* ]] && PARTS="$PARTS tier_tests tier_bench "
part tier_tests 180 "${PYP[@]}" -m pytest -q -m gpu -p no:cacheprovider -rA tests/engine/test_kv_tier_gpu.py
part tier_bench 180 "${PYP[@]}" bench/kv_tier_gpu.py --json "$OUT/kv_tier_gpu.json"
# Where the host's time goes in a CUDA-graph decode step at batch 1 with the next step prepared
# during this one (the gap left to the HBM floor is the host work that stays serial: reading the
# sampled tokens, the outputs, the schedule, the replay): py-spy samples bench/gpu_step.py;
# folded stacks in $OUT/profile-graphs-b1.txt (`bench/profile_top.py` sums them by function).
# PROFILE_BACKEND picks another backend; GPU_PROFILE=0 skips it.
PYSPY=$(command -v py-spy || { [ -n "${site:-}" ] && [ -x "$site/bin/py-spy" ] && echo "$site/bin/py-spy"; } || true)
if [ "${GPU_PROFILE:-1}" = 1 ] && [ -n "$PYSPY" ]; then
    part profile "${PROFILE_LIMIT_S:-240}" "$PYSPY" record -r 250 -f raw -o "$OUT/profile-graphs-b1.txt" -- \
        "${PYP[@]}" bench/gpu_step.py --backends "${PROFILE_BACKEND:-flashinfer+graphs+overlap}" --batches 1 --steps "${PROFILE_STEPS:-4000}" \
        --transfer-blocks 0 --json "$OUT/profile-step.json"
fi
# Every test file with a `gpu`-marked test, but the tier's (its own part above): a new one is
# picked up without editing this list (tests/engine/test_sampling_controls.py's was missed by
# the hand-kept list until 2026-11-30)
GPU_TESTS=${GPU_TESTS:-$(grep -rl --include='test_*.py' -e 'mark\.gpu' tests | grep -v test_kv_tier_gpu.py | sort | tr '\n' ' ')}
# Six pytest workers where pytest-xdist is installed (the device image has it): run one after
# another, the FlashInfer JIT builds alone passed a 290 s limit on 2026-11-30 (docs/gpu/)
XDIST=$("${PYP[@]}" -c "import xdist" 2>/dev/null && echo "-n 6" || true)
# shellcheck disable=SC2086
part tests "${TESTS_LIMIT_S:-420}" "${PYP[@]}" -m pytest -q -m gpu -p no:cacheprovider -rA --durations=15 \
    -k "not default_settings" ${PYTEST_ARGS:-$XDIST} $GPU_TESTS
# engines at default settings take most of the device: alone, after the others
part tests_alone 120 "${PYP[@]}" -m pytest -q -m gpu -p no:cacheprovider -rA -k default_settings $GPU_TESTS
part gpu_step "${BENCH_LIMIT_S:-300}" "${PYP[@]}" bench/gpu_step.py --json "$OUT/gpu_step.json" ${GPU_STEP_ARGS:-}
# The Llama-3-8B shape (16 GB of bf16 weights drawn on the device): the graph step with and
# without the overlap, batches 1 and 64 (issue 62's second floor target)
part gpu_step_8b "${BENCH_8B_LIMIT_S:-300}" "${PYP[@]}" bench/gpu_step.py --shape 8b --transfer-blocks 0 \
    --backends flashinfer+graphs,flashinfer+graphs+overlap,flashinfer+graphs+async --batches 1,64 --json "$OUT/gpu_step_8b.json"
# Speculative decoding on the device (issue 59): n-gram against none at batches 1, 8 and 64, on
# the 1B shape gpu_step made (random weights: the `repeat` workload, whose phrase prompt lookup
# finds; bench/spec.py), acceptance printed beside each speed figure
SPEC_MODEL=${SPEC_MODEL:-.cache/models/pdserve-1b-llama-bfloat16}
if [[ "$PARTS" == *" spec "* ]] && [ ! -f "$SPEC_MODEL/config.json" ]; then
    echo "== gpu-check: spec skipped: no model at $SPEC_MODEL (run the gpu_step part first, or set SPEC_MODEL)"
else
    part spec "${SPEC_LIMIT_S:-240}" "${PYP[@]}" -m pdserve.bench.spec --model "$SPEC_MODEL" --device cuda \
        --workload repeat --batches 1,8,64 --rounds 3 --json "$OUT/spec_gpu.json"
fi
# FP8 KV on the device against 16-bit KV (issue 58): greedy agreement and the first token's KL
# on the bench model's shape, bfloat16, the scales computed at start (docs/kv_cache.md)
part fp8_kv "${FP8_LIMIT_S:-180}" "${PYP[@]}" -m pdserve.bench.fp8_kv --device cuda --dtype bfloat16 \
    --prompts "${FP8_PROMPTS:-100}" --scales head,tensor
# A simulator cost profile measured on this device (issue 34): the Llama-3.2-1B shape, random
# weights, the fast path (FlashInfer, decode CUDA graphs); `pdserve sim profile --roofline
# llama-3.2-1b --gpu h200` is the datasheet profile to hold it against
SIM_MODEL=${SIM_MODEL:-/tmp/pdserve-sim-1b}
[[ "$PARTS" == *" sim_profile "* ]] && PARTS="$PARTS sim_model "
part sim_model 120 "${PYP[@]}" -c "
import sys
from pdserve.engine.model_maker import ModelSpec, make_model
make_model(sys.argv[1], ModelSpec(dtype='bfloat16', num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                                  intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                                  max_position_embeddings=8192))" "$SIM_MODEL"
# (through sim_cmd alone: `pdserve`'s CLI imports the control plane, which needs pydantic)
part sim_profile "${SIM_LIMIT_S:-240}" "${PYP[@]}" -c "
import argparse, sys
from pdserve import sim_cmd
p = argparse.ArgumentParser(prog='pdserve')
sim_cmd.register(p.add_subparsers())
a = p.parse_args(sys.argv[1:])
sys.exit(a.func(a))" sim profile --model "$SIM_MODEL" \
    --name "Llama-3.2-1B shape, measured on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" \
    --engine-arg device=cuda --engine-arg dtype=bfloat16 --engine-arg attention_backend=flashinfer \
    --engine-arg cuda_graphs=true --engine-arg gpu_memory_utilization=0.5 --out "$OUT/sim-profile-gpu.yaml"
exit $status
