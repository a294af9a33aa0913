# Sourced by run.sh and mixed.sh: cadence-serve with speculative decoding off on port 8123 and
# on on 8124, side by side (extra cadence-serve flags in $@), stopped when the script exits.
start_servers() {
  .venv/bin/cadence-serve --port=8123 --speculative=off "$@" > $out/serve-off.log 2>&1 &
  local off=$!
  .venv/bin/cadence-serve --port=8124 --speculative=ngram "$@" > $out/serve-ngram.log 2>&1 &
  local ngram=$!
  trap "kill $off $ngram 2>/dev/null || true" EXIT
  for port in 8123 8124; do
    until curl -sf http://127.0.0.1:$port/health | grep -q '"ok"'; do sleep 2; done
  done
}
port_of() { [ "$1" = off ] && echo 8123 || echo 8124; }
