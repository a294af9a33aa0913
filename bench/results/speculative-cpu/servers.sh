# Sourced by run.sh and mixed.sh: one cadence-serve per speculative mode in $MODES (default
# "off ngram"), side by side on ports 8123, 8124, ... (extra cadence-serve flags in $@; the
# draft mode's model in $DRAFT_MODEL), stopped when the script exits.
modes=${MODES:-off ngram}
start_servers() {
  local pids="" i=0 mode
  for mode in $modes; do
    case $mode in
      draft) local flags="--speculative=draft --draft_model=$DRAFT_MODEL" ;;
      *) local flags="--speculative=$mode" ;;
    esac
    .venv/bin/cadence-serve --port=$((8123 + i)) $flags "$@" > $out/serve-$mode.log 2>&1 &
    pids="$pids $!"; i=$((i + 1))
  done
  trap "kill $pids 2>/dev/null || true" EXIT
  for mode in $modes; do
    until curl -sf http://127.0.0.1:$(port_of $mode)/health | grep -q '"ok"'; do sleep 2; done
  done
}
port_of() {  # the port of mode $1
  local i=0 mode
  for mode in $modes; do
    [ "$mode" = "$1" ] && { echo $((8123 + i)); return; }
    i=$((i + 1))
  done
}
