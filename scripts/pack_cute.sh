#!/usr/bin/env bash
# Pack the CUTLASS DSL (backend="cute") and the GPU peers for the lent GPU machine, whose image has neither
# and whose every call takes at most 64 MiB of working tree (its wheels are ~92 MiB as they come).
#   scripts/pack_cute.sh OUTDIR [--subset]
# OUTDIR must lie under this checkout's .cache/ (ignored by git: never committed), e.g. .cache/cute. It gets:
#   cute_site.tar.xz  the unpacked wheels (a site-packages folder, site/), one solid tar compressed with
#                     `xz -9e` behind the x86 BCJ filter with a 256 MiB dictionary (the cu13 library and the
#                     base library share most of their machine code; ~55 MiB, ~10+ min of one core)
#   install_cute.sh   to be sourced: unpacks the tar once into $FUSEDCE_CUTE_SITE (default
#                     /tmp/fusedce-cute-site) and puts it on PYTHONPATH, with the CUTLASS DSL's
#                     dsl_packages folder (what the wheel's .pth file would add)
#   MANIFEST.txt      the wheels packed
# The wheels (cp312, manylinux_2_28 x86_64, as on the image): nvidia-cutlass-dsl at pyproject's `cute` pin
# with its libs-base, libs-core and libs-cu13 (the image's torch is a CUDA 13 build); the peers Liger-Kernel,
# cut-cross-entropy, quack-kernels with quack's apache-tvm-ffi and torch-c-dlpack-ext. What the image has
# already (KINDS.md: cuda-bindings, protobuf, einops, typing-extensions) is not packed, so that its own
# versions are used, not shadowed from PYTHONPATH.
# --subset: the small wheels only (no CUTLASS libraries): a quick check of the script itself.
# Last: artifact + install script + the tracked files of this checkout must stay under 64 MiB (the call's
# limit for the working tree and its carried paths); else it fails, saying by how much.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LIMIT=$((64 * 1024 * 1024))
[[ $# -ge 1 ]] || { echo "usage: scripts/pack_cute.sh OUTDIR [--subset]" >&2; exit 2; }
OUT=$(realpath -m "$1")
subset=0
[[ "${2:-}" == "--subset" ]] && subset=1
case "$OUT/" in
  "$ROOT/.cache/"*) ;;
  *) echo "pack_cute.sh: OUTDIR must be under $ROOT/.cache/ (git ignores it), got $OUT" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PIP=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$WORK/wheels")

# nvidia-cutlass-dsl as pyproject's cute extra pins it (e.g. "nvidia-cutlass-dsl>=4.8,<5")
spec=$(sed -n 's/^cute = \["\(nvidia-cutlass-dsl[^"]*\)"\]/\1/p' pyproject.toml)
[[ -n "$spec" ]] || { echo "pack_cute.sh: no cute extra in pyproject.toml" >&2; exit 1; }
# quack-kernels 0.5.3: 0.6.2-0.6.5 fail at import beside nvidia-cutlass-dsl 4.8.1 (TypeError: "epilogue fn
# depends on <ContextVar _LOC_TRANSFORMS> ... no fail-closed semantic key"), 0.5.3 imports (checked on CPU,
# Python 3.12 + torch 2.11; its kernels are unverified: it names cutlass-dsl 4.6.0.dev0, --no-deps here).
peers=(liger-kernel cut-cross-entropy quack-kernels==0.5.3 "apache-tvm-ffi<0.2,>=0.1.6" torch-c-dlpack-ext)
if [[ $subset == 1 ]]; then
  "${PIP[@]}" "${peers[@]}"
else
  "${PIP[@]}" "$spec"
  version=$(ls "$WORK"/wheels/nvidia_cutlass_dsl-*.whl | sed 's/.*nvidia_cutlass_dsl-\([^-]*\)-.*/\1/')
  "${PIP[@]}" "nvidia-cutlass-dsl-libs-base==$version" "nvidia-cutlass-dsl-libs-core==$version" \
    "nvidia-cutlass-dsl-libs-cu13==$version" "${peers[@]}"
fi
mkdir -p "$WORK/site" "$OUT"
for wheel in "$WORK"/wheels/*.whl; do
  unzip -q -o "$wheel" -d "$WORK/site"
done
rm -f "$WORK"/site/*.pth   # install_cute.sh puts dsl_packages on PYTHONPATH instead
echo "wheels: $(du -cb "$WORK"/wheels/*.whl | tail -1 | cut -f1) bytes; unpacked: $(du -sb "$WORK/site" | cut -f1) bytes"
(cd "$WORK/wheels" && ls *.whl) > "$OUT/MANIFEST.txt"
tar -C "$WORK" --sort=name --owner=0 --group=0 --numeric-owner -cf - site \
  | xz -9e --x86 --lzma2=preset=9e,dict=256MiB -T1 > "$OUT/cute_site.tar.xz.part"
mv "$OUT/cute_site.tar.xz.part" "$OUT/cute_site.tar.xz"

cat > "$OUT/install_cute.sh" <<'INSTALL'
# Sourced (`. .cache/cute/install_cute.sh`): the CUTLASS DSL and the GPU peers from cute_site.tar.xz
# beside this file, unpacked once into $FUSEDCE_CUTE_SITE (default /tmp/fusedce-cute-site) and put on
# PYTHONPATH with the DSL's dsl_packages folder. Written by scripts/pack_cute.sh.
_fusedce_cute_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_fusedce_cute_dest=${FUSEDCE_CUTE_SITE:-/tmp/fusedce-cute-site}
if [[ ! -f "$_fusedce_cute_dest/.unpacked" ]]; then
  mkdir -p "$_fusedce_cute_dest" \
    && xz -dc "$_fusedce_cute_here/cute_site.tar.xz" | tar -x -C "$_fusedce_cute_dest" \
    && touch "$_fusedce_cute_dest/.unpacked"
fi
if [[ -f "$_fusedce_cute_dest/.unpacked" ]]; then
  export PYTHONPATH="$_fusedce_cute_dest/site:$_fusedce_cute_dest/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  echo "install_cute.sh: CuTe DSL and peers on PYTHONPATH from $_fusedce_cute_dest/site"
else
  echo "install_cute.sh: unpacking $_fusedce_cute_here/cute_site.tar.xz failed; CuTe and peers stay absent"
fi
unset _fusedce_cute_here _fusedce_cute_dest
INSTALL

artifact=$(( $(stat -c %s "$OUT/cute_site.tar.xz") + $(stat -c %s "$OUT/install_cute.sh") + $(stat -c %s "$OUT/MANIFEST.txt") ))
tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((artifact + tracked))
printf 'artifact %.1f MiB + tracked files %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
  "$(echo "$artifact / 1048576" | bc -l)" "$(echo "$tracked / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if (( total >= LIMIT )); then
  echo "pack_cute.sh: over the device call's 64 MiB by $(( (total - LIMIT) / 1024 )) KiB" >&2
  exit 1
fi
[[ $subset == 1 ]] && echo "(--subset: no CUTLASS libraries in this artifact)"
echo "wrote $OUT/cute_site.tar.xz and $OUT/install_cute.sh"
