#!/usr/bin/env bash
# The machine's busy CPU seconds and the wall time over one command (CONTRIBUTING.md, "Tests"):
#     scripts/busy_cpu.sh LABEL COMMAND...
# Busy is /proc/stat's user + nice + system + irq + softirq + steal, before and after: every process
# counted, those a fork server reaped too (which /usr/bin/time misses). Run it on an otherwise idle
# machine. Prints "LABEL: rc=N wall W s, busy CPU B s" to stderr; exits with COMMAND's code.
set -u
label=$1; shift
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
b0=$(busy); t0=$(date +%s.%N)
"$@"; rc=$?
b1=$(busy); t1=$(date +%s.%N)
hz=$(getconf CLK_TCK)
awk -v l="$label" -v rc="$rc" -v t0="$t0" -v t1="$t1" -v b0="$b0" -v b1="$b1" -v hz="$hz" \
    'BEGIN { printf "%s: rc=%d wall %.1f s, busy CPU %.0f s\n", l, rc, t1 - t0, (b1 - b0) / hz }' >&2
exit $rc
