#!/usr/bin/env bash
# The example end to end: a private RabbitMQ node on loopback (the repository's tooling),
# a worker with four prefork children, then examples/celery/send.py. Stops what it started.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$here"
scripts/setup >/dev/null
was_running=0
scripts/broker status >/dev/null 2>&1 && was_running=1
export AMQP_URL="$(scripts/broker start)"
export PYTHONPATH="$here"
log="$(mktemp -d)/worker.log"
.venv/bin/celery -A examples.celery.tasks worker --pool prefork --concurrency 4 \
  --loglevel INFO --logfile "$log" --without-gossip --without-mingle >"$log.out" 2>&1 &
worker=$!
finish() {
  kill -TERM "$worker" 2>/dev/null && wait "$worker" 2>/dev/null || true
  [ "$was_running" = 1 ] || scripts/broker stop >/dev/null 2>&1 || true
}
trap finish EXIT
# Ready once it answers a ping (it consumes from then on).
for _ in $(seq 1 60); do
  .venv/bin/celery -A examples.celery.tasks inspect ping --timeout 1 >/dev/null 2>&1 && break
  sleep 1
done
.venv/bin/python -m examples.celery.send
echo "(worker log: $log)"
