#!/usr/bin/env bash
# The example end to end: a private RabbitMQ node on loopback (the repository's tooling),
# a worker with four prefork children, then examples/celery/send.py. Stops what it started.
#
# Each run has its own node (name, free ports, data directory) and worker name, so two
# copies run side by side; a node that fails to start stops the script.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$here"
scripts/setup >/dev/null
run="$(mktemp -d)"
node="celery-example-$$"
worker=""
finish() {
  if [ -n "$worker" ]; then
    kill -TERM "$worker" 2>/dev/null && wait "$worker" 2>/dev/null || true
  fi
  scripts/broker stop --name "$node" --base-dir "$run/broker" >/dev/null 2>&1 \
    && rm -rf "$run/broker" || true
  if [ -n "$worker" ]; then echo "(worker log: $run/worker.log)"; else rm -rf "$run"; fi
}
trap finish EXIT
# Assigned, then exported: `export X="$(cmd)"` would hide cmd's failure from `set -e`.
AMQP_URL="$(scripts/broker start --name "$node" --base-dir "$run/broker")"
export AMQP_URL
export PYTHONPATH="$here"
# Four slots: send.py's build_report needs two at once, call_partner's lock_limit=3 three.
.venv/bin/celery -A examples.celery.tasks worker --pool prefork --concurrency 4 \
  --hostname "$node@%h" --loglevel INFO --logfile "$run/worker.log" \
  --without-gossip --without-mingle >"$run/worker.out" 2>&1 &
worker=$!
# Ready once it answers a ping (it consumes from then on).
ready=0
for _ in $(seq 1 60); do
  if .venv/bin/celery -A examples.celery.tasks inspect ping --timeout 1 >/dev/null 2>&1; then
    ready=1
    break
  fi
  kill -0 "$worker" 2>/dev/null || break
  sleep 1
done
if [ "$ready" != 1 ]; then
  echo "the worker did not start:" >&2
  cat "$run/worker.out" "$run/worker.log" >&2 2>/dev/null || true
  exit 1
fi
.venv/bin/python -m examples.celery.send
