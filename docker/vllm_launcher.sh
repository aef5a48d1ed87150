#!/usr/bin/env bash
# Puts a `vllm` command into the image's venv ($1) that runs the image's vLLM with the venv's interpreter,
# so `vllm serve` sees this package's vllm.general_plugins entry point (the base image's own `vllm` script
# runs the system interpreter, which does not see the venv).
set -euo pipefail
venv=${1:?usage: vllm_launcher.sh VENV}
cat > "$venv/bin/vllm" <<PY
#!$venv/bin/python
import sys

from vllm.entrypoints.cli.main import main

sys.exit(main())
PY
chmod +x "$venv/bin/vllm"
