# Sourced by scripts/test.sh (after env.sh, in the repository root): the megatron-core wheel
# from which tests/unit/test_layout_reference.py loads Megatron-LM's DSA layout helpers (one
# plain-torch file, read from the zip; the wheel is never installed). Downloaded once, without
# dependencies, into .cache/wheels/ (git ignores it); its path is exported as
# SP_KPOOL_MEGATRON_WHEEL. megatron-core 0.19.0 is the first release with
# experimental_attention_variant/dsa_layout.py and needs Python >= 3.12, so the download names
# the wheel's Python, ABI and platform instead of this interpreter's, and the hash pins the
# exact file. If the download fails the test skips, except under CI (SP_KPOOL_CI), where it
# fails. Keep the version equal to MEGATRON_VERSION in the test.
megatron_version=0.19.2
megatron_sha256=8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5
megatron_wheel=".cache/wheels/megatron_core-$megatron_version-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
if [ -f "$megatron_wheel" ] && ! echo "$megatron_sha256  $megatron_wheel" | sha256sum -c --status; then
  echo "[sp_kpool] $megatron_wheel: wrong sha256, downloading it again"
  rm -f "$megatron_wheel"
fi
if [ ! -f "$megatron_wheel" ]; then
  echo "[sp_kpool] downloading megatron-core $megatron_version (the wheel only, no dependencies) into .cache/wheels/"
  mkdir -p .cache/wheels
  python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --require-hashes -d .cache/wheels \
    -r /dev/stdin <<<"megatron-core==$megatron_version --hash=sha256:$megatron_sha256" ||
    echo "[sp_kpool] warning: megatron-core $megatron_version could not be downloaded (tests/unit/test_layout_reference.py skips, or fails under CI)"
fi
if [ -f "$megatron_wheel" ]; then
  export SP_KPOOL_MEGATRON_WHEEL="$PWD/$megatron_wheel"
fi
