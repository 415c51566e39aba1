#!/usr/bin/env bash
# The device bundle (../shared/device: setup.sh, wheels/, tl_site.tar.xz) in two halves, for a tree that no longer
# fits one call's 64 MiB beside the whole bundle (docs/STUDY.md, "The bundle in two halves"). Here:
#
#   bash scripts/device/devbundle_in.sh split      # .devbundle (or ../shared/device) -> .cache/devbundle/{tl,base}
#
# On the device, two calls back to back, the first of a lease:
#   carry [".cache/devbundle/tl"]:    bash scripts/device/devbundle_in.sh tl     # the TileLang archive -> /tmp
#   carry [".cache/devbundle/base"]:  bash scripts/device/devbundle_in.sh base && source .devbundle/setup.sh && ...
# `base` rebuilds .devbundle there (setup.sh, wheels/, and a link to the archive); the device keeps that ignored
# folder between calls while the machine is warm, so later calls carry neither half and start with
# `source .devbundle/setup.sh` as before.
set -eu
WHERE=${DEVBUNDLE_TMP:-/tmp/devbundle-tl}
case "${1:-}" in
  split)
    src=.devbundle; [ -f "$src/setup.sh" ] || src=../shared/device
    [ -f "$src/tl_site.tar.xz" ] || { echo "no bundle at .devbundle or ../shared/device" >&2; exit 2; }
    rm -rf .cache/devbundle && mkdir -p .cache/devbundle/tl .cache/devbundle/base
    cp "$src/tl_site.tar.xz" .cache/devbundle/tl/
    cp -r "$src/setup.sh" "$src/wheels" .cache/devbundle/base/
    chmod -R u+w .cache/devbundle
    du -sk .cache/devbundle/tl .cache/devbundle/base ;;
  tl)
    mkdir -p "$WHERE" && cp .cache/devbundle/tl/tl_site.tar.xz "$WHERE/" && ls -l "$WHERE" ;;
  base)
    [ -f "$WHERE/tl_site.tar.xz" ] || { echo "no $WHERE/tl_site.tar.xz: run the 'tl' call first (a fresh machine?)" >&2; exit 3; }
    rm -rf .devbundle && mkdir -p .devbundle
    cp -r .cache/devbundle/base/. .devbundle/
    ln -s "$WHERE/tl_site.tar.xz" .devbundle/tl_site.tar.xz
    echo "devbundle: $(ls .devbundle | tr '\n' ' ')" ;;
  *)
    echo "usage: $0 split|tl|base (docs/STUDY.md)" >&2; exit 2 ;;
esac
