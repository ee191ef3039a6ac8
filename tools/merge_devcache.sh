#!/usr/bin/env bash
# Fold what one device call brought back into the caches the next call carries (.devcache/):
# fla's autotune results and the TileLang cache entries the call added, repacked without the
# cubins .devcache/cubins.tar.xz already holds (the carried tree is limited to 64 MiB).
#   e.g.  bash tools/merge_devcache.sh /work/.device/3
set -eu
from=${1:?the folder holding the files of one device call}
cache=.devcache
mkdir -p "$cache"
[ -f "$from/autotune.tgz" ] && tar -xzf "$from/autotune.tgz" -C "$cache"
[ -f "$from/tlcache.tar.xz" ] || exit 0
xz -t "$from/tlcache.tar.xz"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -f "$cache/tlcache.tar.xz" ] && tar -xJf "$cache/tlcache.tar.xz" -C "$work"
tar -xJf "$from/tlcache.tar.xz" -C "$work"
: > "$work/.skip"
[ -f "$cache/cubins.tar.xz" ] && tar -tJf "$cache/cubins.tar.xz" | grep -v '/$' | sed 's|^\./||; s|^|tlcache/|' > "$work/.skip"
(cd "$work" && tar -I "xz -T0 -9" -cf tlcache.tar.xz --exclude-from=.skip tlcache)
mv "$work/tlcache.tar.xz" "$cache/tlcache.tar.xz"
ls -la "$cache/tlcache.tar.xz"
