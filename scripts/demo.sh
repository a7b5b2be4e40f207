#!/usr/bin/env bash
# The main job: a 4-rank CPU (gloo) run of the indexer on an odd-length packed sequence,
# checked bit for bit against world size 1. Extra arguments go to `python -m sp_kpool demo`.
source "$(dirname "$0")/env.sh"
exec python -m sp_kpool demo "$@"
