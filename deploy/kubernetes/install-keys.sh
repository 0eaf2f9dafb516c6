#!/usr/bin/env bash
# Copies the CURVE keys from their Secret volumes into a private folder with the
# modes wsd accepts. The pods run it as an initContainer, as the same user as the
# main container (coordinator.yaml, workers.yaml; kustomization.yaml makes it
# the ConfigMap wsd-install-keys).
#
# Why a copy: wsd refuses a secret key file that group or others can read. With
# fsGroup set on the pod (the coordinator needs it to write its state volume),
# the kubelet makes every file of a Secret volume group-readable (the mode bits
# are OR'd with 0440, whatever defaultMode says), so NAME.key_secret mounted
# straight from a Secret is refused. Without fsGroup the files belong to root
# and a non-root user cannot read a 0400 file at all. So each pod mounts its
# Secrets under SECRETS, readable through fsGroup, and this script installs them,
# owned by the pod's user, into KEYS (an emptyDir in memory):
#   *.key_secret  mode 0600   (wsd: no access for group or others)
#   anything else mode 0644   (public keys: wsd refuses ones others may write)
# keeping the relative paths: SECRETS/viewer/grafana.key -> KEYS/viewer/grafana.key.
# Every folder is created, empty ones too (an optional Secret that does not
# exist mounts as an empty folder: a role with no keys, not a missing folder).
# The ..data and ..<timestamp> entries the kubelet adds are skipped.
#
# Keys are read once, when the pod starts, as wsd itself reads them: to change
# keys, update the Secret and restart the pods.
set -euo pipefail

SECRETS=${SECRETS:?SECRETS: the folder the Secret volumes are mounted under}
KEYS=${KEYS:?KEYS: the folder to install the keys into}
umask 077

cd "$SECRETS"
count=0
while IFS= read -r -d '' folder; do
    install -d -m 0755 "$KEYS/$folder"
done < <(find -L . -mindepth 1 -type d ! -path '*/..*' -print0)
while IFS= read -r -d '' file; do
    case $file in
        *.key_secret) mode=0600 ;;
        *) mode=0644 ;;
    esac
    install -D -m "$mode" "$file" "$KEYS/$file"
    count=$((count + 1))
done < <(find -L . -type f ! -path '*/..*' -print0)
printf 'wsd-install-keys: %d key files installed in %s\n' "$count" "$KEYS"
