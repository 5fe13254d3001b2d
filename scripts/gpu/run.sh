#!/usr/bin/env bash
# The GPU check in one device command, on the lent machine (its own Python 3.12 and torch; no
# network): the carry built here first (`make gpu-carry`: .gpu-carry/, named in the device call's
# `carry`), then
#     bash scripts/gpu/run.sh [scripts/gpu/check.py's options]
# It installs the carry into /tmp/site, turns on Orbit's GPU stand-ins (scripts/gpu/standins) and
# SGLang's plain-torch and Triton paths, runs scripts/gpu/check.py, and leaves its report and log
# in $OUT (the device tool's folder that comes back), else runs/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu-check}
mkdir -p "$out"
t0=$(date +%s)
if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu-carry/*.whl > "$out/install.log" 2>&1; then
    echo "the carry did not install:"; tail -20 "$out/install.log"; exit 1
fi
echo "carry installed in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$PWD/scripts/gpu/standins:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the stand-ins (orbit_gpu_standins.py); SGLang's torch fused ops, not sgl_kernel's; no version
# check of sgl_kernel; the radix tree in Python (its Rust extension is cut from the carry); no
# FlashInfer; no DeepGEMM JIT; torch.cuda.is_available() asks NVML, so a process that asks can
# still fork CUDA users
export ORBIT_GPU_STANDINS=1 SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
    SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python SGLANG_IS_FLASHINFER_AVAILABLE=false \
    SGLANG_ENABLE_JIT_DEEPGEMM=0 PYTORCH_NVML_BASED_CUDA_CHECK=1 TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 scripts/gpu/check.py --out "$out" --work /tmp/gpu-check "$@" 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
