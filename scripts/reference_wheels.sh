# Sourced by scripts/test.sh (after env.sh, in the repository root): wheels whose files the
# unit tests read as references, never installed. Each is downloaded once, without
# dependencies, into .cache/wheels/ (git ignores it), pinned by its sha256, and its path is
# exported:
#
# - megatron-core (SP_KPOOL_MEGATRON_WHEEL): tests/unit/test_layout_reference.py loads
#   Megatron-LM's DSA layout helpers (one plain-torch file, read from the zip). 0.19.0 is the
#   first release with experimental_attention_variant/dsa_layout.py and needs Python >= 3.12,
#   so the download names the wheel's Python, ABI and platform instead of this interpreter's.
#   Keep the version equal to MEGATRON_VERSION in tests/unit/megatron_ref.py.
# - tokenspeed-deepgemm (SP_KPOOL_DEEPGEMM_WHEEL): tests/unit/test_cuda_fp8_mqa_ptx.py compiles
#   DeepGEMM's SM90 fp8_mqa_logits template from the wheel's headers with nvcc and compares
#   its PTX with our CUDA kernel's. Keep the version equal to DEEPGEMM_VERSION there.
#
# If a download fails the tests that need the wheel skip, except under CI (SP_KPOOL_CI),
# where they fail.
reference_wheel() {  # reference_wheel SPEC SHA256 FILE VARIABLE
  local spec=$1 sha=$2 wheel=".cache/wheels/$3" var=$4
  if [ -f "$wheel" ] && ! echo "$sha  $wheel" | sha256sum -c --status; then
    echo "[sp_kpool] $wheel: wrong sha256, downloading it again"
    rm -f "$wheel"
  fi
  if [ ! -f "$wheel" ]; then
    echo "[sp_kpool] downloading $spec (the wheel only, no dependencies) into .cache/wheels/"
    mkdir -p .cache/wheels
    python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux_2_28_x86_64 --require-hashes -d .cache/wheels \
      -r /dev/stdin <<<"$spec --hash=sha256:$sha" ||
      echo "[sp_kpool] warning: $spec could not be downloaded (the tests that read it skip, or fail under CI)"
  fi
  if [ -f "$wheel" ]; then
    export "$var=$PWD/$wheel"
  fi
}

reference_wheel "megatron-core==0.19.2" 8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5 \
  megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl SP_KPOOL_MEGATRON_WHEEL
reference_wheel "tokenspeed-deepgemm==2.5.0.post20260629" dfb7c56d47bbd4b021eed51c882f03c8c1e80c8da031d887bb44e86e24de89da \
  tokenspeed_deepgemm-2.5.0.post20260629-cp312-cp312-manylinux_2_28_x86_64.whl SP_KPOOL_DEEPGEMM_WHEEL
