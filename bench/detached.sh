#!/usr/bin/env bash
# On the GPU machine: gpu_scale.py runs back to back, detached from the device call that starts them, and their
# result files collected by later calls (one call runs at most 10 minutes; an idle machine is handed back in ~30 s,
# so the last call must still be polling when the runs end).
#   bench/detached.sh start "--shape 1.7b --only build,loop" "--shape 4b --steps 2 --only build,loop" ...
#   bench/detached.sh poll SECONDS   # result files, progress and log tails to $OUT every 20 s; returns once all ran
# Poll in calls of a few minutes (~240 s), not one long one: a call's files come back only when it returns, and a
# machine taken back mid-call returns nothing of that call.
# Every phase gets a 600 s watchdog; a line's own --phase-timeout-s wins (argparse keeps the last): 8B's loop needs
# ~720 s for 3 steps (start 140 s, then ~130 s a step), so pass "--phase-timeout-s 900" on its line.
# A variant of a phase (say, the loop under --set) writes its own file: end its line with
#   --out /tmp/vime-detached/out-NAME --copy-to /tmp/vime-detached/res/NAME   (polls bring res/NAME/ back too)
# A start keeps the files of the batch before it under $ROOT/earlier/<time>/ and refuses while one still runs.
# The runs work from a copy of the checkout (a device call replaces the checkout it runs in) and write under $ROOT.
# ../shared/gpu/INSTALL.sh must have run on the machine (it writes /tmp/site-env.sh).
set -u
ROOT=${VIME_DETACHED_ROOT:-/tmp/vime-detached}
case "${1:-}" in
  start)
    shift
    if [ -f "$ROOT/run.pid" ] && kill -0 "$(cat "$ROOT/run.pid")" 2> /dev/null; then
      echo "a detached batch is still running under $ROOT: poll it until DONE, then start" >&2; exit 2
    fi
    if [ -d "$ROOT/res" ]; then  # an earlier batch's files stay on the machine: earlier/<time>/ (polls bring them)
      keep="$ROOT/earlier/$(date +%Y%m%d-%H%M%S)" && mkdir -p "$keep"
      for x in "$ROOT"/*; do case "${x##*/}" in repo|earlier) ;; *) mv "$x" "$keep/" ;; esac; done
    fi
    rm -rf "$ROOT/repo" && mkdir -p "$ROOT/res" && cp -r "$PWD" "$ROOT/repo"
    printf '%s\n' "$@" > "$ROOT/runs.txt"
    setsid nohup bash "$0" run > "$ROOT/detached.out" 2>&1 < /dev/null &
    echo $! > "$ROOT/run.pid"
    echo "started $# run(s); poll with: bench/detached.sh poll SECONDS" ;;
  run)  # the detached body: each line of runs.txt is one gpu_scale.py command line
    . /tmp/site-env.sh && cd "$ROOT/repo" || exit 1
    t0=$(date +%s); k=0
    while IFS= read -r line; do
      k=$((k + 1))
      echo "[$(( $(date +%s) - t0 ))s] start $k: $line" >> "$ROOT/res/progress.txt"
      # shellcheck disable=SC2086  # the line is a command line: split on purpose
      python3 bench/gpu_scale.py --out "$ROOT/out" --copy-to "$ROOT/res" --phase-timeout-s 600 $line \
        > "$ROOT/res/run$k.log" 2>&1
      rc=$?
      echo "[$(( $(date +%s) - t0 ))s] done $k rc=$rc" >> "$ROOT/res/progress.txt"
    done < "$ROOT/runs.txt"
    touch "$ROOT/res/DONE" ;;
  poll)
    limit=${2:-500}; t0=$(date +%s)
    snap() {
      mkdir -p "$OUT" && cp -f "$ROOT"/res/*.json "$ROOT/res/progress.txt" "$OUT"/ 2>/dev/null
      for f in "$ROOT"/res/*.log; do [ -e "$f" ] && tail -c 60000 "$f" > "$OUT/$(basename "$f")"; done
      for d in "$ROOT"/res/*/; do  # a line's own --copy-to under res/ (a variant beside the main result file)
        [ -d "$d" ] && mkdir -p "$OUT/$(basename "$d")" && cp -f "$d"*.json "$OUT/$(basename "$d")/" 2>/dev/null
      done
      for d in "$ROOT"/earlier/*/res; do  # the result files of batches started before this one (no logs)
        [ -d "$d" ] || continue
        k="$OUT/earlier-$(basename "$(dirname "$d")")" && mkdir -p "$k"
        (cd "$d" && find . \( -name '*.json' -o -name progress.txt \) -exec cp --parents -f {} "$k/" \;)
      done
    }
    while [ $(( $(date +%s) - t0 )) -lt "$limit" ] && [ ! -e "$ROOT/res/DONE" ]; do snap; sleep 20; done
    snap; cat "$ROOT/res/progress.txt" 2>/dev/null
    for f in "$ROOT"/res/*.log; do [ -e "$f" ] && { echo "== $f"; grep -iE '^\[gpu_scale\]|error' "$f" | tail -4; }; done
    true ;;  # a batch without logs yet is no failed poll
  *) echo "usage: bench/detached.sh start \"<gpu_scale.py args>\" ... | poll SECONDS" >&2; exit 2 ;;
esac
