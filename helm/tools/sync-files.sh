#!/usr/bin/env bash
# Copies the monitoring files the chart packages from deploy/ into helm/kvrelay/files/ (Helm reads
# only files inside the chart, and does not follow symlinks out of it when packaging). Run it after
# changing deploy/prometheus/kvrelay-alerts.yaml or deploy/grafana/*.json;
# tests/helm/test_chart.py fails while the copies differ from the originals.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FILES="$ROOT/helm/kvrelay/files"
mkdir -p "$FILES/prometheus" "$FILES/grafana"
rm -f "$FILES"/prometheus/kvrelay-alerts.yaml "$FILES"/grafana/*.json
if [ -f "$ROOT/deploy/prometheus/kvrelay-alerts.yaml" ]; then
    cp "$ROOT/deploy/prometheus/kvrelay-alerts.yaml" "$FILES/prometheus/"
fi
for dashboard in "$ROOT"/deploy/grafana/*.json; do
    [ -e "$dashboard" ] && cp "$dashboard" "$FILES/grafana/"
done
ls -R "$FILES"
