#!/usr/bin/env bash
# Coverage-guided fuzzing, time-boxed: each target in fuzz/ runs for
# FUZZ_SECONDS (default 40) on a temporary copy of its committed corpus, so
# a run leaves the checkout clean. The targets build against leasehold's
# core (no default features). A crash fails the run and prints the input.
# Needs cargo-fuzz (installed here if missing) and RUSTC_BOOTSTRAP=1, which
# lets the stable toolchain take the sanitizer flags cargo-fuzz passes.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${FUZZ_SECONDS:-40}
command -v cargo-fuzz >/dev/null || cargo install --locked --quiet cargo-fuzz
export RUSTC_BOOTSTRAP=1
work=$(mktemp -d)
# cargo-fuzz makes fuzz/artifacts/<target>/ even when nothing crashed;
# crashes go to $work, so only empty directories are removed here.
trap 'rm -rf "$work"; find fuzz/artifacts -type d -empty -delete 2>/dev/null || true' EXIT
targets=(rules_loader json_request decide_memory)
cargo fuzz build --fuzz-dir fuzz --target-dir target/fuzz -O
for t in "${targets[@]}"; do
  mkdir -p "$work/$t" "$work/artifacts/$t"
  cp fuzz/corpus/"$t"/* "$work/$t/"
  seeds=$(ls "$work/$t" | wc -l)
  echo "fuzz $t: ${SECONDS_EACH}s from $seeds seeds"
  cargo fuzz run --fuzz-dir fuzz --target-dir target/fuzz -O "$t" "$work/$t" -- \
    -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$work/artifacts/$t/" -print_final_stats=1 2>"$work/$t.log" || {
    echo "fuzz $t FAILED:"; tail -40 "$work/$t.log"
    for a in "$work/artifacts/$t"/*; do [ -f "$a" ] && { echo "input $a:"; od -c "$a" | head -20; }; done
    exit 1
  }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$work/$t.log" | tr '\n' ' '
  echo "corpus now $(ls "$work/$t" | wc -l) inputs"
done
