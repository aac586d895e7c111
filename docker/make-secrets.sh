#!/bin/sh
# Creates the secrets of docker/compose.yaml in docker/secrets/ (random values; existing files are kept).
# The folder is 0700 (only you can reach the files on the host); the files are 0644 because compose mounts them
# into containers that run as other users (stam 10001, redis 999, grafana 472).
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
mkdir -p "$dir"
chmod 0700 "$dir"
rand() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
make() {  # make NAME VALUE
  if [ -s "$dir/$1" ]; then echo "kept    $dir/$1"; return; fi
  printf '%s\n' "$2" > "$dir/$1"
  chmod 0644 "$dir/$1"
  echo "created $dir/$1"
}
# Master key that seals the per-patient data keys (32 bytes, base64). Losing it makes every sealed message
# unreadable: back it up outside this host.
make stam_data_key "$(python3 -c 'import base64, secrets; print(base64.b64encode(secrets.token_bytes(32)).decode())')"
make STAM_REDIS_PASSWORD "$(rand)"
make STAM_MILVUS_TOKEN "root:$(rand)"
make STAM_QUERY_TOKEN "$(rand)"
make minio_root_user "stam-minio"
make minio_root_password "$(rand)"
make grafana_admin_password "$(rand)"
