#!/usr/bin/env bash
# The Prometheus Operator's CRDs for the kinds the chart renders (ServiceMonitor,
# PodMonitor, PrometheusRule), pinned, from the Go module proxy: the module carries
# them in example/prometheus-operator-crd/. e2e installs them so `kubectl apply
# --dry-run=server` checks the chart's monitoring objects against their real schemas.
# Prints the directory holding them ($OUT_DIR); a second run is offline.
set -euo pipefail

PO_VERSION="${PO_VERSION:-v0.85.0}"
OUT_DIR="${OUT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmserve/prometheus-operator-crds/$PO_VERSION}"
KINDS=(servicemonitors podmonitors prometheusrules)

present=1
for k in "${KINDS[@]}"; do [ -s "$OUT_DIR/monitoring.coreos.com_$k.yaml" ] || present=0; done
if [ "$present" = 0 ]; then
  mkdir -p "$OUT_DIR"
  # Outside any module: `go mod download` fetches into the module cache and says where.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  dir=$(cd "$tmp" && GOFLAGS=-mod=mod go mod download -json \
          "github.com/prometheus-operator/prometheus-operator@$PO_VERSION" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  for k in "${KINDS[@]}"; do
    install -m 0644 "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$k.yaml" "$OUT_DIR/"
  done
fi
echo "$OUT_DIR"
