#!/usr/bin/env bash
# Build Prometheus (the server, no web UI assets: only its HTTP API is used) from
# the Go module proxy, pinned, for benchmarks/serving/render_dashboards.py. Output:
# $BIN_DIR/prometheus. The Go caches make a rebuild quick; a cold build takes
# several minutes on 2 cores.
set -euo pipefail

# Prometheus 3.x is published to the module proxy as v0.3XX.Y (3.16.0 -> v0.316.0).
PROM_MODULE_VERSION="${PROM_MODULE_VERSION:-v0.316.0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/llmserve/prometheus/$PROM_MODULE_VERSION"
BIN_DIR="${BIN_DIR:-$CACHE/bin}"
WORK="$CACHE/src"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" GOTOOLCHAIN=local
mkdir -p "$BIN_DIR" "$WORK"

if [ -x "$BIN_DIR/prometheus" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "$BIN_DIR/prometheus"
  exit 0
fi
t0=$(date +%s)
cat > "$WORK/go.mod" <<GOMOD
module llmserve.local/prometheusbuild

go 1.25

require github.com/prometheus/prometheus $PROM_MODULE_VERSION
GOMOD
cat > "$WORK/tools.go" <<'GO'
//go:build tools

package tools

import _ "github.com/prometheus/prometheus/cmd/prometheus"
GO
cd "$WORK"
go mod tidy -e >/dev/null 2>&1 || true
v=github.com/prometheus/common/version
go build -tags tools,remove_all_sd -ldflags "-s -w -X $v.Version=$PROM_MODULE_VERSION" \
  -o "$BIN_DIR/prometheus" github.com/prometheus/prometheus/cmd/prometheus >&2
echo "prometheus built in $(( $(date +%s) - t0 )) s" >&2
echo "$BIN_DIR/prometheus"
