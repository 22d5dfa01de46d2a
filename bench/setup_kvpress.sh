#!/usr/bin/env bash
# Venv for bench/kvpress_needle.py: kvpress 0.5.5 on top of the system torch/numpy/gguf/pykv.
#   bash bench/setup_kvpress.sh [VENV]        (default /tmp/kvpress-venv)
# kvpress 0.5.5 needs transformers<5.3, so transformers 5.2.0 shadows the system's newer one.
set -euo pipefail
VENV="${1:-/tmp/kvpress-venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -c 'import kvpress, transformers; assert transformers.__version__ == "5.2.0"' 2>/dev/null \
  || "$VENV/bin/pip" install -q "kvpress==0.5.5" "transformers==5.2.0"
"$VENV/bin/python" -c 'import torch, transformers, kvpress, pykv; print("torch", torch.__version__, "transformers", transformers.__version__, "kvpress ok")'
echo "run: $VENV/bin/python bench/kvpress_needle.py --help"
