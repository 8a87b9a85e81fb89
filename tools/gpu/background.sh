#!/usr/bin/env bash
# GPU work longer than one device call (10 minutes at most), or run while later calls carry the next chunks.
# A warm machine keeps /tmp and the processes that started a session of their own, so a job started here runs
# on between calls; send the next call within 30 s to keep the machine. From the repo root on the device:
#   bash tools/gpu/background.sh start NAME 'commands'   start the commands in a session of their own; they see
#                                                      OUT=/tmp/bg/NAME/out; their output is /tmp/bg/NAME/log
#   bash tools/gpu/background.sh wait NAME [SECONDS]    wait until NAME ends (at most SECONDS, default 540)
#   bash tools/gpu/background.sh status                 one line per job, and the tail of the running ones' logs
#   bash tools/gpu/background.sh collect                every job's folder packed into $OUT/bg.tgz (end each
#                                                      call with it: what a call brings back survives the machine)
#   bash tools/gpu/background.sh stop NAME              end NAME and everything it started
# BG sets the folder (default /tmp/bg).
set -u
bg=${BG:-/tmp/bg}
ended() { [ -f "$bg/$1/rc" ]; }
case "${1:-}" in
  start)
    name=${2:?a name}; cmd=${3:?the commands}
    [ -d "$bg/$name" ] && { echo "$name exists already in $bg"; exit 2; }
    mkdir -p "$bg/$name/out"
    # the exit code is written last, so `wait` sees the job end only once its output is complete
    OUT="$bg/$name/out" setsid bash -c '(eval "$1"); echo $? > "$0/rc"' "$bg/$name" "$cmd" > "$bg/$name/log" 2>&1 < /dev/null &
    echo $! > "$bg/$name/pid"
    echo "$name started, pid $(cat "$bg/$name/pid")" ;;
  wait)
    name=${2:?a name}; limit=${3:-540}; t0=$SECONDS
    [ -d "$bg/$name" ] || { echo "no job $name"; exit 2; }
    while ! ended "$name" && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 2; done
    tail -n "${TAIL:-30}" "$bg/$name/log"
    if ended "$name"; then echo "$name ended: exit $(cat "$bg/$name/rc")"
    else echo "$name still running after $((SECONDS - t0)) s of waiting"; fi ;;
  status)
    for d in "$bg"/*/; do
      [ -d "$d" ] || continue
      name=$(basename "$d")
      if ended "$name"; then echo "$name: ended, exit $(cat "$d/rc")"
      else echo "$name: running"; tail -n "${TAIL:-5}" "$d/log" | sed 's/^/    /'; fi
    done ;;
  collect)
    out=${OUT:?OUT is not set}
    tar czf "$out/bg.tgz" -C "$bg" . && ls -la "$out/bg.tgz" ;;
  stop)
    name=${2:?a name}
    pid=$(cat "$bg/$name/pid" 2>/dev/null) && kill -- -"$pid" 2>/dev/null
    echo "$name stopped" ;;
  *) echo "usage: background.sh start NAME 'commands' | wait NAME [SECONDS] | status | collect | stop NAME"; exit 2 ;;
esac
