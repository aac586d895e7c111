#!/bin/sh
# Secrets mounted as files named after a STAM_* variable (compose `secrets:` with `target: STAM_REDIS_PASSWORD`,
# or a Kubernetes Secret volume at /run/secrets) become that variable for the process, unless it is already set.
# Settings read only the environment; this keeps secret values out of `docker inspect` and the compose file.
# File-valued settings (STAM_DATA_KEY_FILE, STAM_QUERY_TOKENS_FILE, STAM_SOURCES_FILE) point at their files directly.
set -eu
if [ -d /run/secrets ]; then
  for f in /run/secrets/STAM_*; do
    [ -f "$f" ] || continue
    name=${f##*/}
    case "$name" in
      *[!A-Z0-9_]*) echo "stam-entrypoint: skipping secret file with an odd name: $name" >&2; continue ;;
    esac
    eval "isset=\${$name+x}"
    if [ -z "$isset" ]; then
      value=$(cat "$f")
      export "$name=$value"
    fi
  done
fi
exec "$@"
