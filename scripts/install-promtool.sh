#!/usr/bin/env bash
# promtool lints our metrics exposition; Debian's `prometheus` package ships it.
set -euo pipefail
command -v promtool >/dev/null && exit 0
if [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
else
  echo "promtool missing: run 'apt-get install prometheus' as root" >&2
  exit 1
fi
command -v promtool >/dev/null
