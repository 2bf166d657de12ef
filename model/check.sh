#!/usr/bin/env bash
# Model-check the relay protocol (model/relay.pml) with Spin; see docs/model.md.
#
#   model/check.sh            the CI suite (under a minute): safety and
#                             liveness of the model, safety of wider sizes, and
#                             the variants that must FAIL (FREEZE_BUG, ...)
#   model/check.sh --full     also liveness of the wider sizes (minutes)
#   ONLY=REGEX model/check.sh  only the checks whose label matches REGEX
#   model/check.sh run MODE [-DNAME[=VALUE] ...]
#                             one check, pan's own output on stdout;
#                             MODE is safety or liveness (tests/test_model.py)
#
# Exits non-zero when a check that must pass finds a violation, when a check
# that must fail does not, or when a search is incomplete. Everything is
# compiled in a temporary directory, never in the repository; set KEEP=1 to
# keep it (it holds pan and any .trail for `spin -t -p relay.pml`).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
model="$here/relay.pml"
SPIN="${SPIN:-spin}"
CC="${CC:-gcc}"
DEPTH="${DEPTH:-200000}"   # pan -m: deeper than any run here reaches

for tool in "$SPIN" "$CC"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "model/check.sh: '$tool' is not installed (Debian: apt-get install -y spin gcc)" >&2
    exit 2
  fi
done

work="$(mktemp -d "${TMPDIR:-/tmp}/outbox-model.XXXXXX")"
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    # Each check has a directory of its own below: relay.pml, pan, any .trail.
    echo "kept $work:" "$work"/run.* >&2
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

# pan MODE [defines...]: generate, compile and run one verifier in its own
# directory under $work; print pan's output.
pan() {
  local mode="$1"; shift
  local dir
  dir="$(mktemp -d "$work/run.XXXXXX")"
  cp "$model" "$dir/relay.pml"
  (
    cd "$dir"
    case "$mode" in
      safety)
        # Assertions in every reachable state (the monitor, the inline
        # checks); no never claim.
        "$SPIN" "$@" -a relay.pml >spin.out 2>&1 || { cat spin.out; exit 1; }
        "$CC" -O1 -w -DSAFETY -DNOCLAIM -DMEMLIM=4096 -o pan pan.c
        ./pan -m"$DEPTH"
        ;;
      liveness)
        # The `live` claim (<> every row done or dead), acceptance cycles
        # under weak fairness (-a -f). NFAIR sizes the fairness bookkeeping
        # for the model's 8-9 processes. The monitor is left out: an
        # always-enabled assertion loop adds nothing to a cycle search.
        "$SPIN" -DNOMONITOR "$@" -a relay.pml >spin.out 2>&1 || { cat spin.out; exit 1; }
        "$CC" -O1 -w -DNFAIR=4 -DMEMLIM=4096 -o pan pan.c
        ./pan -a -f -m"$DEPTH"
        ;;
      *)
        echo "unknown mode '$mode' (safety or liveness)" >&2
        exit 2
        ;;
    esac
  )
}

if [ "${1:-}" = run ]; then
  shift
  [ $# -ge 1 ] || { echo "usage: model/check.sh run safety|liveness [-DNAME ...]" >&2; exit 2; }
  pan "$@"
  exit 0
fi

full=0
[ "${1:-}" = --full ] && full=1

failures=0

# check EXPECT MODE LABEL [defines...]; EXPECT is pass or fail.
check() {
  local expect="$1" mode="$2" label="$3"; shift 3
  local out errors states depth secs search verdict got
  if [ -n "${ONLY:-}" ] && ! grep -qE -- "$ONLY" <<<"$label"; then
    return 0
  fi
  local start end
  start="$(date +%s.%N)"
  out="$(pan "$mode" "$@" 2>&1)" || true
  end="$(date +%s.%N)"
  errors="$(sed -n 's/.*errors: \([0-9][0-9]*\).*/\1/p' <<<"$out" | tail -1)"
  states="$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' <<<"$out" | tail -1)"
  depth="$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' <<<"$out" | tail -1)"
  search="$(sed -n 's/^pan: elapsed time \([0-9.e+-]*\) seconds.*/\1/p' <<<"$out" | tail -1)"
  secs="$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')"
  if [ -z "$errors" ] || grep -q "max search depth too small\|out of memory\|pan: error" <<<"$out"; then
    got=broken
  elif [ "$errors" = 0 ] && grep -q "Search not completed\|reached -DMEMLIM bound" <<<"$out"; then
    # No error found, but not every state was seen (pan stopped at its
    # memory limit): that is no pass. (A failing run prints the same
    # warning, because it stops at its first error.)
    got=broken
  elif [ "$errors" = 0 ]; then
    got=pass
  else
    got=fail
  fi
  if [ "$got" = "$expect" ]; then verdict=ok; else verdict=WRONG; failures=$((failures + 1)); fi
  printf '%-5s %-9s %-34s expected %-4s got %-6s %9s states  depth %3s  search %5ss  all %5ss\n' \
    "$verdict" "$mode" "$label" "$expect" "$got" "${states:-?}" "${depth:-?}" "${search:-?}" "$secs"
  if [ "$got" = fail ]; then
    # The first violation pan reports (an assertion, or an acceptance cycle).
    grep -m1 "^pan:1:" <<<"$out" | cut -c1-150 | sed 's/^/        /'
  fi
  if [ "$verdict" = WRONG ]; then
    echo "$out" | grep -v "^\s*relay.pml:\|unreached\|^\s*(.* of .* states)" | sed 's/^/      | /'
  fi
}

echo "== the relay protocol (2 rows, 2 workers, max_attempts 2, cap 1, at most 2 faults)"
check pass safety   "model"
check pass liveness "model"

echo "== wider sizes"
check pass safety   "max_attempts 3"                  -DMAX_ATTEMPTS=3
check pass safety   "cap 2"                           -DCAP=2 -DK=5
check pass safety   "3 workers"                       -DNW=3
if [ "$full" = 1 ]; then
  check pass safety   "3 faults"                      -DFAULTS=3
  check pass safety   "3 rows"                        -DNROWS=3
  check pass liveness "max_attempts 3"                -DMAX_ATTEMPTS=3
  check pass liveness "3 workers"                     -DNW=3
  check pass liveness "3 faults"                      -DFAULTS=3
  check pass liveness "3 rows"                        -DNROWS=3
fi

echo "== a claim leaves rows for following runs only while their queue is long (frag_held)"
# At cap 1 the cap alone already stops a claim while a row is queued.
check pass liveness "hold, cap 2"                     -DCAP=2 -DK=5
check fail liveness "HOLD_ALWAYS, cap 2"              -DCAP=2 -DK=5 -DHOLD_ALWAYS

echo "== the historical freeze: must fail liveness"
check pass safety   "FREEZE_BUG"                      -DFREEZE_BUG
check fail liveness "FREEZE_BUG"                      -DFREEZE_BUG

echo "== the checker catches a weaker fence: must fail"
check fail safety   "WEAK_FENCE (no lease test)"      -DWEAK_FENCE
check fail safety   "NO_VERSION_FENCE"                -DNO_VERSION_FENCE

echo "== duplicated tasks count one attempt per lease version (migration 0005): must pass"
check pass safety   "STRICT_ATTEMPTS"                 -DSTRICT_ATTEMPTS
check pass safety   "STRICT_ATTEMPTS, no duplicates"  -DSTRICT_ATTEMPTS -DDUP=0

echo "== a release leaves a begun row to its delivery (unless_begun): must pass"
check pass safety   "NO_STEAL"                        -DNO_STEAL

echo "== duplicated tasks by design, and the release as it was (docs/model.md): must fail"
check fail safety   "EXCLUSIVE"                       -DEXCLUSIVE
check fail safety   "NO_STEAL, RELEASE_BEGUN"         -DNO_STEAL -DRELEASE_BEGUN

if [ "$failures" -ne 0 ]; then
  echo "model/check.sh: $failures check(s) did not give the expected result" >&2
  exit 1
fi
echo "model/check.sh: every check gave the expected result"
