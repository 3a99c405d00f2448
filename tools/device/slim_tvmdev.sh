#!/usr/bin/env bash
# Shrink .tvmdev (from ../shared/device/pack-tvm.sh) so that it and the tracked tree stay under the
# device tool's 64 MiB carry limit. From the root, after pack-tvm.sh:
#
#   bash tools/device/slim_tvmdev.sh
#
# Drops what nothing imports on the GPU machine (NOTES, sessions 12 and 36):
#   the apache-tvm-ffi wheel: tvm_ffi/3rdparty/ and tvm_ffi/src/ (sources; their RECORD lines too)
#   tvm-py.tar.xz: the tflite and stablehlo frontends, contrib/hexagon, licenses, cmake files
# Keep tvm/backend/hexagon (``import tvm`` loads it) and tvm_ffi's libtvm_ffi_testing.so (core links it).
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
whl=$(ls .tvmdev/apache_tvm_ffi-*.whl)
before=$(du -cb .tvmdev/* | tail -1 | cut -f1)

mkdir "$work/w" && (cd "$work/w" && unzip -q "$OLDPWD/$whl")
rm -rf "$work/w/tvm_ffi/3rdparty" "$work/w/tvm_ffi/src"
record=$(ls "$work"/w/*.dist-info/RECORD)
grep -v -E '^tvm_ffi/(3rdparty|src)/' "$record" > "$record.new" && mv "$record.new" "$record"
rm "$whl" && (cd "$work/w" && zip -q -9 -r "$OLDPWD/$whl" .)

mkdir "$work/t" && tar -C "$work/t" -xJf .tvmdev/tvm-py.tar.xz
rm -rf "$work"/t/tvm/relax/frontend/{tflite,stablehlo} "$work/t/tvm/contrib/hexagon" \
  "$work/t/tvm/licenses" "$work/t/tvm/cmake" "$work/t/tvm/lib64/cmake"
tar -C "$work/t" -cf - tvm | xz -9e -T1 > .tvmdev/tvm-py.tar.xz

echo "slim_tvmdev: $before -> $(du -cb .tvmdev/* | tail -1 | cut -f1) bytes;" \
  "tracked tree $(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}') bytes"
