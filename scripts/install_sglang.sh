#!/usr/bin/env bash
# Install SGLang (Orbit's `engine.backend: sglang`) into a virtual environment.
#
#   bash scripts/install_sglang.sh VENV_DIR
#
# - creates VENV_DIR if it does not exist (with $PY, default python3); reuses it otherwise;
# - CPU-only machine: torch 2.13.0 CPU held by constraints.txt, sglang's CPU-usable requirements
#   (requirements/sglang-cpu.txt) installed normally, sglang itself with --no-deps (its metadata
#   pins torch==2.14.1 and CUDA-only packages), plus a .pth hook in site-packages that applies
#   Orbit's torchvision fix (shim (a) in orbit/engine/sglang_cpu) in every process of the venv;
# - machine with CUDA (nvidia-smi works, or ORBIT_SGLANG_DEVICE=cuda): `pip install sglang` as
#   upstream intends (CUDA torch and kernels come with it);
# - idempotent: a stamp in VENV_DIR records what was installed; a second run with the same inputs
#   only checks the import and exits.
#
# Orbit itself is not installed here: `pip install -c constraints.txt -e .` into the same venv
# afterwards (or before) works with this set (docs/sglang.md).
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/install_sglang.sh VENV_DIR" >&2
    exit 2
fi
VENV=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONSTRAINTS=$ROOT/constraints.txt
REQS=$ROOT/requirements/sglang-cpu.txt
SHIMS=$ROOT/orbit/engine/sglang_cpu/pypath
PY=${PY:-python3}

device=${ORBIT_SGLANG_DEVICE:-}
if [[ -z $device ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        device=cuda
    else
        device=cpu
    fi
fi
if [[ $device != cpu && $device != cuda ]]; then
    echo "ORBIT_SGLANG_DEVICE must be cpu or cuda, got '$device'" >&2
    exit 2
fi

if [[ ! -x $VENV/bin/python ]]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
VPY=$VENV/bin/python
PIP=("$VPY" -m pip)

stamp_file=$VENV/.orbit-sglang-stamp
stamp=$(cat "$0" "$REQS" "$CONSTRAINTS" "$SHIMS/orbit_sglang_cpu_shims.py" | sha256sum | cut -d' ' -f1)
stamp="$device $SGLANG_VERSION $stamp"

check_import() {
    # Import sglang's engine module the way Orbit runs it (CPU: with the shims on).
    if [[ $device == cpu ]]; then
        PYTHONPATH="$SHIMS${PYTHONPATH:+:$PYTHONPATH}" ORBIT_SGLANG_CPU_SHIMS=1 SGLANG_USE_CPU_ENGINE=1 \
            "$VPY" -W ignore -c "import sglang, sglang.srt.entrypoints.engine as e; print('sglang', sglang.__version__, 'ok')" 2>/dev/null
    else
        "$VPY" -W ignore -c "import sglang, sglang.srt.entrypoints.engine as e; print('sglang', sglang.__version__, 'ok')" 2>/dev/null
    fi
}

if [[ -f $stamp_file && $(cat "$stamp_file") == "$stamp" ]] && check_import >/dev/null; then
    echo "sglang $SGLANG_VERSION ($device) already installed in $VENV"
    exit 0
fi

t0=$(date +%s)
if [[ $device == cuda ]]; then
    # Upstream's own dependency set. NB: sglang 0.5.23 pins torch==2.14.1, Orbit's constraints.txt
    # pins the CPU torch 2.13.0: on a GPU machine install Orbit after this without that pin.
    "${PIP[@]}" install -q "sglang==$SGLANG_VERSION"
else
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
    "${PIP[@]}" install -q -c "$CONSTRAINTS" -r "$REQS"
    "${PIP[@]}" install -q --no-deps "sglang==$SGLANG_VERSION"
    # Shim (a) for the whole venv: the CUDA torchvision wheel breaks `import torchvision` (and so
    # transformers' image utilities) in *every* process, not only SGLang's. The hook is lazy: it
    # does nothing until torchvision is imported, and nothing on a machine with CUDA.
    site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cp "$SHIMS/orbit_sglang_cpu_shims.py" "$site/orbit_sglang_cpu_shims.py"
    echo "import orbit_sglang_cpu_shims; orbit_sglang_cpu_shims.install_torchvision_fix()" \
        > "$site/orbit_sglang_cpu.pth"
fi

if ! check_import; then
    echo "sglang installed but its engine module does not import; run the check by hand:" >&2
    echo "  PYTHONPATH=$SHIMS ORBIT_SGLANG_CPU_SHIMS=1 SGLANG_USE_CPU_ENGINE=1 $VPY -c 'import sglang.srt.entrypoints.engine'" >&2
    exit 1
fi
echo "$stamp" > "$stamp_file"
echo "installed sglang $SGLANG_VERSION ($device) into $VENV in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
