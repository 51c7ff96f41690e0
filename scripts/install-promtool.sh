#!/usr/bin/env bash
# promtool lints our metrics exposition, and a real Prometheus server scrapes the agent in a test; Debian's
# `prometheus` package ships both.
set -euo pipefail
command -v promtool >/dev/null && command -v prometheus >/dev/null && exit 0
if [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
else
  echo "promtool or prometheus missing: run 'apt-get install prometheus' as root" >&2
  exit 1
fi
command -v promtool >/dev/null && command -v prometheus >/dev/null
