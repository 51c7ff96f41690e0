#!/usr/bin/env bash
# Build the real Kubernetes test environment from Go modules (see
# shared/spec/k8s-test-env.md): kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok, the upstream sample-device-plugin,
# squat/generic-device-plugin (when its pin resolves), our kubelet
# device-manager harness, our kubelet checkpoint peer, our Allocate benchmark client
# (allocate-bench, for benchmarks/proxy.py) and our admission load generator (admit-load, for
# benchmarks/compare.py); squat/generic-device-plugin
# from its vendored source (see build_gdp below).
#
# Binaries go to ${DEVICEPLANE_K8S_CACHE:-~/.cache/deviceplane/k8s}/<k8s-version>-<key>/bin,
# where <key> hashes the wrapper modules (go.mod, go.sum), their Go sources and
# this script. A warm run (stamp present) only prints and exits.
#
#   bash tests/k8s/build.sh                 build or reuse
#   bash tests/k8s/build.sh --print-bin-dir print the bin dir for this checkout (no build)
#   bash tests/k8s/build.sh --force         rebuild even if the stamp exists
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${DEVICEPLANE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deviceplane/k8s}

die() { echo "k8s-bins: ERROR: $*" >&2; exit 1; }

modver() { # modver <go.mod> <module path> -> version required there
  awk -v m="$2" '$1==m && $2 ~ /^v/ {print $2; exit} $1=="require" && $2==m {print $3; exit}' "$1"
}

k8s_version=$(modver "$here/go.mod" k8s.io/kubernetes)
[ -n "$k8s_version" ] || die "cannot read the k8s.io/kubernetes version from $here/go.mod"
etcd_version=$(modver "$here/etcd/go.mod" go.etcd.io/etcd/server/v3)
kwok_version=$(modver "$here/kwok/go.mod" sigs.k8s.io/kwok)

# Cache key: every input that changes what is built.
key=$(cd "$here" && {
  find . \( -name go.mod -o -name go.sum -o -name '*.go' -o -name '*.s' \) -type f | LC_ALL=C sort
  echo ./build.sh
} | while read -r f; do printf '%s\n' "$f"; cat "$f"; done | sha256sum | cut -c1-12)
out="$cache_root/${k8s_version}-${key}"
bin="$out/bin"

force=0
case "${1:-}" in
  --print-bin-dir) echo "$bin"; exit 0 ;;
  --force) force=1 ;;
  "") ;;
  *) die "unknown argument $1 (use --print-bin-dir or --force)" ;;
esac

# squat/generic-device-plugin: upstream source with vendored modules, shipped beside the checkout (the main
# checkout's ../shared/third_party/generic-device-plugin; DEVICEPLANE_GDP_SRC overrides). Cached by a hash of that
# source and the Go version, apart from the Kubernetes key (a new plugin version does not rebuild Kubernetes), then
# copied into $bin, where the e2e fixtures look.
gdp_src() {
  local common
  if [ -n "${DEVICEPLANE_GDP_SRC:-}" ]; then echo "$DEVICEPLANE_GDP_SRC"; return; fi
  common=$(git -C "$here" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
  for d in "$here/../../../shared/third_party/generic-device-plugin" \
           ${common:+"$common/../../shared/third_party/generic-device-plugin"}; do
    if [ -f "$d/go.mod" ]; then (cd "$d" && pwd); return; fi
  done
}
build_gdp() {
  local src gkey gout
  src=$(gdp_src)
  if [ -z "$src" ]; then
    [ "${DEVICEPLANE_E2E:-}" = required ] && die "generic-device-plugin source not found (set DEVICEPLANE_GDP_SRC)"
    echo "k8s-bins: WARNING: generic-device-plugin source not found; its e2e tests will skip" >&2
    return 0
  fi
  gkey=$( (cd "$src" && find . -type f ! -path './.git/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
           go env GOVERSION) | sha256sum | cut -c1-12)
  gout="$cache_root/gdp-$gkey"
  if [ ! -x "$gout/generic-device-plugin" ]; then
    local t0; t0=$(date +%s)
    echo "k8s-bins: building generic-device-plugin from $src ..."
    mkdir -p "$gout"
    (cd "$src" && GOFLAGS="-mod=vendor -buildvcs=false" go build -trimpath -ldflags "-s -w" -o "$gout/generic-device-plugin.partial" .) \
      || die "building generic-device-plugin failed (in $src: GOFLAGS=-mod=vendor go build)"
    mv "$gout/generic-device-plugin.partial" "$gout/generic-device-plugin"
    echo "k8s-bins: built generic-device-plugin in $(( $(date +%s) - t0 ))s (key $gkey)"
  fi
  if ! cmp -s "$gout/generic-device-plugin" "$bin/generic-device-plugin"; then
    cp "$gout/generic-device-plugin" "$bin/generic-device-plugin.partial"
    mv "$bin/generic-device-plugin.partial" "$bin/generic-device-plugin"
    echo "generic-device-plugin $src (key $gkey)" >> "$bin/VERSIONS"
  fi
}

if [ "$force" = 0 ] && [ -f "$out/stamp" ]; then
  echo "k8s-bins: up to date: $bin (Kubernetes $k8s_version, key $key)"
  if command -v go >/dev/null; then export GOTOOLCHAIN=local CGO_ENABLED=0; build_gdp; fi
  exit 0
fi

if ! command -v go >/dev/null; then
  if [ "${DEVICEPLANE_E2E:-}" = required ]; then
    die "Go is not installed (DEVICEPLANE_E2E=required): install Go >= 1.26.0 with the module proxy"
  fi
  echo "k8s-bins: WARNING: Go is not installed; nothing built, the e2e tests will skip (install Go >= 1.26.0)" >&2
  exit 0
fi
export GOTOOLCHAIN=local CGO_ENABLED=0
# -mod=readonly: build exactly the checked-in go.mod/go.sum (no silent upgrades).
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=readonly -buildvcs=false"
gov=$(go env GOVERSION)
case "$gov" in
  go1.2[6-9]*|go1.[3-9][0-9]*) ;;
  *) die "Kubernetes $k8s_version needs Go >= 1.26.0, found $gov (GOTOOLCHAIN=local: no toolchain download)" ;;
esac

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9 # one build at a time per cache
if [ "$force" = 0 ] && [ -f "$out/stamp" ]; then
  echo "k8s-bins: up to date (built by a concurrent run): $bin"; exit 0
fi

tmp="$out/bin.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
t_all=$(date +%s)
step() { # step <name> <dir> <go build args...>
  local name=$1 dir=$2; shift 2
  local t0; t0=$(date +%s)
  echo "k8s-bins: building $name ..."
  if ! (cd "$dir" && go build -trimpath "$@"); then
    die "building $name failed (in $dir: go build $*)"
  fi
  echo "k8s-bins: built $name in $(( $(date +%s) - t0 ))s"
}

minor=$(echo "$k8s_version" | cut -d. -f2)
k8s_ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${k8s_version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor} -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=${k8s_version} -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=${minor}"

step "Kubernetes $k8s_version (kube-apiserver kube-controller-manager kube-scheduler kubectl sample-device-plugin kubelet-harness checkpoint-peer allocate-bench admit-load)" \
  "$here" -tags=selinux,notest -ldflags "$k8s_ldflags" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/test/images/sample-device-plugin ./kubelet-harness ./checkpoint-peer ./allocate-bench ./admit-load
step "etcd $etcd_version" "$here/etcd" -ldflags "-s -w" -o "$tmp/etcd" .
step "kwok $kwok_version" "$here/kwok" \
  -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${kwok_version#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${k8s_version#v}" \
  -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok
# kwok ships no built-in stages: assemble the "fast" set (what kwokctl uses) from the module's own kustomize/stage.
kwok_dir=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok) || die "cannot locate the kwok module source"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  [ -f "$kwok_dir/kustomize/stage/$f" ] || die "kwok stage $f not found in $kwok_dir"
  echo "---"
  cat "$kwok_dir/kustomize/stage/$f"
done > "$tmp/kwok-stages.yaml"

# Smoke: every binary runs and reports the pinned version.
# (Output captured first: with pipefail, `cmd | grep -q` fails whenever grep exits before cmd has written everything.)
v=$("$tmp/kube-apiserver" --version)
grep -qx "Kubernetes ${k8s_version}" <<<"$v" || die "kube-apiserver --version is not ${k8s_version}: $v"
v=$("$tmp/etcd" --version)
grep -q "etcd Version: ${etcd_version#v}" <<<"$v" || die "etcd --version is not ${etcd_version}: $v"
"$tmp/kwok" --version >/dev/null 2>&1 || die "kwok --version failed"

{
  echo "kubernetes ${k8s_version}"
  echo "etcd ${etcd_version}"
  echo "kwok ${kwok_version}"
  echo "sample-device-plugin k8s.io/kubernetes/test/images/sample-device-plugin@${k8s_version}"
  echo "kubelet-harness deviceplane (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager@${k8s_version})"
  echo "checkpoint-peer deviceplane (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/checkpoint@${k8s_version})"
  echo "allocate-bench deviceplane (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 v0.${k8s_version#v1.}, grpc-go)"
  echo "admit-load deviceplane (Go standard library)"
  echo "go ${gov}"
  echo "key ${key}"
} > "$tmp/VERSIONS"

rm -rf "$bin"
mv "$tmp" "$bin"
date -u +%Y-%m-%dT%H:%M:%SZ > "$out/stamp"
build_gdp
# Keep the cache bounded (~500 MB a build): this build plus the 2 most recently built others.
ls -1dt "$cache_root"/v*-*/ 2>/dev/null | grep -vxF "$out/" | tail -n +3 | while read -r old; do
  echo "k8s-bins: pruning old build ${old%/}"
  rm -rf "${old%/}"
done || true
echo "k8s-bins: done in $(( $(date +%s) - t_all ))s -> $bin"
sed 's/^/k8s-bins:   /' "$bin/VERSIONS"
