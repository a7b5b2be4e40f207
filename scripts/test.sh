#!/usr/bin/env bash
# The whole test suite: unit tests, gloo ranks spawned from pytest, torchrun (2, 3, 4
# ranks) and mpirun (4 ranks). Extra arguments go to pytest.
source "$(dirname "$0")/env.sh" test
source scripts/reference_wheels.sh   # the megatron-core wheel of tests/unit/test_layout_reference.py
exec python -m pytest -n 2 --dist loadgroup tests "$@"
