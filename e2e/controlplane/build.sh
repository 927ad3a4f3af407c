#!/usr/bin/env bash
# Build a local Kubernetes control plane from the Go module proxy, pinned:
# kube-apiserver, kube-controller-manager, kube-scheduler and etcd from
# k8s.io/kubernetes, and helm from helm.sh/helm, all in one wrapper module that pins
# every k8s.io staging module to the matching v0.X.Y. One module, so helm compiles
# against the same k8s.io/api, apimachinery and client-go packages as the cluster and
# reuses them (in a module of its own it compiled ~600 packages again, at helm's own
# patch versions). Output: $BIN_DIR. Go's module and build caches (~/go/pkg/mod,
# ~/.cache/go-build) make a warm rebuild take seconds; a cold one takes tens of minutes
# on 2 cores.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.37.2}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN_DIR="${BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmserve/controlplane/$K8S_VERSION/bin}"
WORK="${XDG_CACHE_HOME:-$HOME/.cache}/llmserve/controlplane/$K8S_VERSION/src"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" GOTOOLCHAIN=local
mkdir -p "$BIN_DIR" "$WORK/kube"

stamp() { date +%s; }
t0=$(stamp)

want=(kube-apiserver kube-controller-manager kube-scheduler etcd helm)
# The binaries are rebuilt when this script changes (the Go caches keep that quick).
recipe=$(sha256sum "$0" | cut -c1-16)
missing=0
for b in "${want[@]}"; do [ -x "$BIN_DIR/$b" ] || missing=1; done
[ "$(cat "$BIN_DIR/.recipe" 2>/dev/null)" = "$recipe" ] || missing=1
if [ "$missing" = 0 ] && [ "${FORCE:-0}" != 1 ]; then
  echo "control plane binaries present in $BIN_DIR"
  exit 0
fi

# --- kubernetes, etcd and helm: one wrapper module --------------------------------------
minor="${K8S_VERSION#v1.}"  # 37.2 of v1.37.2
kminor=${minor%%.*}  # 37: the minor that /version reports and helm is stamped with
staging_version="v0.${minor}"
mod_json=$(cd "$WORK" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION")
gomod=$(printf '%s' "$mod_json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
etcd_version=$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2; exit}' "$gomod")
{
  echo "module llmserve.local/controlplane"
  echo
  echo "go $(awk '$1 == "go" {print $2; exit}' "$gomod")"
  echo
  echo "require ("
  echo "	k8s.io/kubernetes $K8S_VERSION"
  echo "	go.etcd.io/etcd/server/v3 $etcd_version"
  echo "	helm.sh/helm/v3 $HELM_VERSION"
  echo ")"
  echo
  echo "replace ("
  # every staging module kubernetes requires at v0.0.0 -> the published v0.X.Y
  awk '$2 == "v0.0.0" && $1 ~ /^k8s\.io\// {print $1}' "$gomod" | sort -u |
    while read -r m; do echo "	$m => $m $staging_version"; done
  echo ")"
} > "$WORK/kube/go.mod"
cat > "$WORK/kube/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "helm.sh/helm/v3/cmd/helm"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
cd "$WORK/kube"
go mod tidy -e >/dev/null 2>&1 || true
go mod download
pkg=k8s.io/component-base/version
cgo=k8s.io/client-go/pkg/version
ld="-s -w"
for p in "$pkg" "$cgo"; do
  ld="$ld -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$kminor"
  ld="$ld -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
  echo "building $cmd $K8S_VERSION ..."
  t=$(stamp)
  go build -tags tools -ldflags "$ld" -o "$BIN_DIR/$cmd" "k8s.io/kubernetes/cmd/$cmd"
  echo "  $cmd: $(( $(stamp) - t )) s"
done
echo "building etcd $etcd_version ..."
t=$(stamp)
go build -ldflags "-s -w" -o "$BIN_DIR/etcd" go.etcd.io/etcd/server/v3
echo "  etcd: $(( $(stamp) - t )) s"

# --- helm ----------------------------------------------------------------------------------
echo "building helm $HELM_VERSION ..."
t=$(stamp)
# Stamp the Kubernetes version helm assumes without a cluster (`helm template`),
# as helm's own Makefile does, from the client-go it is built with: this cluster's.
hl="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  hl="$hl -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$kminor"
done
go build -tags tools -ldflags "$hl" -o "$BIN_DIR/helm" helm.sh/helm/v3/cmd/helm
echo "  helm: $(( $(stamp) - t )) s"
echo "$recipe" > "$BIN_DIR/.recipe"
echo "control plane built in $(( $(stamp) - t0 )) s -> $BIN_DIR"
