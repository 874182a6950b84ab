#!/usr/bin/env bash
# End-to-end check of the Compose deployment on a real Docker daemon (docs/deploy.md):
#   1. builds the images (gateway, redis) on a local base image (docker/build-base.sh), no registry needed;
#   2. starts the stack with Compose: `ingest` ingests a documents directory (the demo corpus, mounted the
#      way your own documents are), then the gateway serves the bundled model mounted as your own model is;
#   3. waits for the gateway's healthcheck, asks POST /query and checks that an answer and sources come back;
#   4. waits for the segment cache's disk tier, restarts the gateway container and asks again: the answer
#      must come from the cache volume (hypic_cache_hits_total{tier="disk"} > 0, composed_tokens > 0), unchanged;
#   5. `down -v` (also on failure, after printing the logs).
#
#   docker/smoke.sh 2>&1 | tee docs/deploy-smoke.txt
#
# Needs docker with the compose plugin (v2), curl and python3; root for build-base.sh. Settings:
#   HYPIC_BASE_IMAGE  base image (default hypic-base:bookworm, built when missing); python:3.11-slim also works
#                     where a registry is reachable
#   HYPIC_SMOKE_PORT  host port of the gateway (default 18080)
#   HYPIC_SMOKE_NETWORK=host  run the containers on the host's network instead of Compose's bridge (for
#                     daemons whose bridge cannot publish ports); the smoke test then uses 127.0.0.1 ports
#   HYPIC_SMOKE_KEEP=1  leave the stack running (no `down -v`) and the classic builder's untagged deps stage
# A torch CPU wheel in docker/wheels/ is used for the image; when there is none, one is fetched with this
# machine's pip (its configured indexes and find-links), else the image downloads torch from the torch index.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH_VERSION="$(python3 -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(re.fullmatch(r"torch==(\S+)", d).group(1) for d in deps if d.startswith("torch==")))')"
export HYPIC_BASE_IMAGE="${HYPIC_BASE_IMAGE:-hypic-base:bookworm}"
export HYPIC_IMAGE="${HYPIC_IMAGE:-hypic-gateway:smoke}"
PORT="${HYPIC_SMOKE_PORT:-18080}"
PROJECT=hypic-smoke   # never the `hypic` project of a real deployment: `down -v` deletes the project's volumes
QUESTION="In which city is Seinaim based?"
EXPECTED="Jasteirk"   # the bundled model's answer (README.md)

log() { printf '[smoke %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
fail() { log "FAIL: $*"; exit 1; }

FILES=(-f docker/compose.yaml -f docker/compose.smoke.yaml)
WORK="$(mktemp -d /tmp/hypic-smoke.XXXXXX)"
if [ "${HYPIC_SMOKE_NETWORK:-bridge}" = host ]; then
    # Host network: no published ports and no service names; each process gets its own 127.0.0.1 port.
    cat > "$WORK/compose.host.yaml" <<EOF
services:
  ingest: {network_mode: host}
  redis:
    network_mode: host
    command: ["redis-server", "--bind", "127.0.0.1", "--port", "$((PORT + 1))", "--save", "", "--appendonly", "no"]
    healthcheck: {test: ["CMD", "redis-cli", "-p", "$((PORT + 1))", "ping"]}
  gateway:
    network_mode: host
    ports: !reset []
    environment:
      HYPIC_HOST: 127.0.0.1
      HYPIC_PORT: "$PORT"
      HYPIC_REDIS_URL: redis://127.0.0.1:$((PORT + 1))/0
EOF
    FILES+=(-f "$WORK/compose.host.yaml")
fi
compose() { docker compose -p "$PROJECT" "${FILES[@]}" "$@"; }

cleanup() {
    local rc=$?
    if [ "$rc" != 0 ]; then
        log "failed (exit $rc): the stack's state and logs follow"
        compose ps -a || true
        compose logs --no-color --tail 80 || true
    fi
    if [ "${HYPIC_SMOKE_KEEP:-0}" = 1 ]; then
        log "HYPIC_SMOKE_KEEP=1: the stack keeps running (docker compose -p $PROJECT ${FILES[*]} down -v)"
    else
        compose down -v --remove-orphans >/dev/null 2>&1 || true
        log "stack removed (down -v)"
        # The classic builder leaves docker/Dockerfile's deps stage as an untagged image; BuildKit leaves none.
        docker image prune -f --filter label=org.hypic-gateway.stage=deps >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "$(date -u '+%Y-%m-%d %H:%M:%S UTC'); $(docker version --format 'docker client {{.Client.Version}}, daemon {{.Server.Version}} (API {{.Server.APIVersion}})'); $(docker compose version)"
log "storage driver $(docker info --format '{{.Driver}}'); network: ${HYPIC_SMOKE_NETWORK:-bridge}; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# 1. Images.
if ! docker image inspect "$HYPIC_BASE_IMAGE" >/dev/null 2>&1; then
    [ "$HYPIC_BASE_IMAGE" = hypic-base:bookworm ] || fail "base image $HYPIC_BASE_IMAGE not found"
    log "building the base image $HYPIC_BASE_IMAGE (debootstrap)"
    docker/build-base.sh "$HYPIC_BASE_IMAGE"
fi
if ! compgen -G "docker/wheels/torch-${TORCH_VERSION}[+-]*.whl" >/dev/null; then
    log "no torch wheel in docker/wheels/: asking this machine's pip for torch==${TORCH_VERSION}+cpu"
    python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 \
        --platform manylinux_2_28_x86_64 -d docker/wheels "torch==${TORCH_VERSION}+cpu" \
        || log "none: the image downloads torch from the torch index"
fi
log "torch wheel for the image: $(cd docker/wheels && ls torch-*.whl 2>/dev/null || echo 'none (torch index)')"
log "building the images (gateway on $HYPIC_BASE_IMAGE, redis from Debian's package)"
compose build
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^(${HYPIC_IMAGE%%:*}|hypic-redis|${HYPIC_BASE_IMAGE%%:*})" | sed 's/^/    /'

# 2. The stack, with the demo corpus as "your documents" and the repository's models/ as "your models".
mkdir -p "$WORK/documents"
cp data/demo_corpus.jsonl "$WORK/documents/"
chmod 755 "$WORK" "$WORK/documents"
chmod 644 "$WORK/documents/demo_corpus.jsonl"
export HYPIC_DOCUMENTS="$WORK/documents" HYPIC_MODELS="$ROOT/models" HYPIC_MODEL=/models/hypic-tiny
export HYPIC_PORT="$PORT" HYPIC_BIND=127.0.0.1 HYPIC_API_KEY=
export HYPIC_CACHE_SECRET="${HYPIC_CACHE_SECRET:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}"  # signs the Redis tier's entries
compose down -v --remove-orphans >/dev/null 2>&1 || true
log "docker compose up -d (ingest first; the gateway waits for it to succeed)"
compose up -d
[ "$(docker inspect --format '{{.State.ExitCode}}' "$(compose ps -a -q ingest)")" = 0 ] || fail "ingest did not succeed"
compose logs --no-color ingest | tail -n 3 | sed 's/^/    /'

URL="http://127.0.0.1:$PORT"
wait_healthy() {
    local id status deadline=$((SECONDS + 300))
    id="$(compose ps -q gateway)"
    while :; do
        status="$(docker inspect --format '{{.State.Health.Status}}' "$id")"
        [ "$status" = healthy ] && break
        [ "$(docker inspect --format '{{.State.Running}}' "$id")" = true ] || fail "gateway container stopped"
        [ "$SECONDS" -lt "$deadline" ] || fail "gateway not healthy after 300 s (status $status)"
        sleep 2
    done
    curl -fsS "$URL/ready" >/dev/null || fail "healthy in Docker but $URL/ready does not answer from the host"
    log "gateway healthy; $URL/ready answers from the host"
}
wait_healthy
PROC_UID="$(compose exec -T gateway id -u)"
DATA_UID="$(compose exec -T gateway stat -c %u /var/lib/hypic/index /var/lib/hypic/cache | sort -u | paste -sd ' ')"
log "gateway runs as uid $PROC_UID; the volume's index and cache belong to uid $DATA_UID"
[ "$PROC_UID $DATA_UID" = "10001 10001" ] || fail "expected uid 10001 for the process and the volume's files"
REDIS_URL="$(compose exec -T gateway printenv HYPIC_REDIS_URL)"
compose exec -T gateway python -c '
import socket, sys, urllib.parse
url = urllib.parse.urlparse(sys.argv[1])
with socket.create_connection((url.hostname, url.port or 6379), timeout=5) as s:
    s.sendall(b"PING\r\n")
    reply = s.recv(256)
    assert reply.startswith(b"+PONG"), reply' "$REDIS_URL" || fail "the gateway cannot reach Redis at $REDIS_URL"
log "the gateway reaches Redis at $REDIS_URL (HYPIC_REDIS_URL)"

query() {  # prints: answer <TAB> sources <TAB> composed_tokens <TAB> cached_tokens <TAB> prompt_tokens
    curl -fsS "$URL/query" -H 'content-type: application/json' \
        -d "{\"question\": \"$QUESTION\", \"top_k\": 5, \"max_tokens\": 16}" > "$WORK/reply.json" \
        || fail "POST /query failed"
    python3 - "$WORK/reply.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
u = r["usage"]
print("\t".join(map(str, [r["answer"].strip().replace("\t", " ").replace("\n", " "), len(r["sources"]),
                          u["composed_tokens"], u["cached_tokens"], u["prompt_tokens"]])))
EOF
}
metric() {  # metric NAME LABELS -> value (0 when absent)
    curl -fsS "$URL/metrics" | python3 -c '
import sys
name, labels = sys.argv[1], sys.argv[2]
total = 0.0
for line in sys.stdin:
    if line.startswith(name + ("{" if labels else " ")) and labels in line:
        total += float(line.rsplit(" ", 1)[1])
print(int(total) if total.is_integer() else total)' "$1" "$2"
}

# 3. A first (cold) query.
IFS=$'\t' read -r ANSWER1 SOURCES1 COMPOSED1 CACHED1 PROMPT1 < <(query)
log "cold:  answer '$ANSWER1'; $SOURCES1 sources; prompt $PROMPT1 tokens, composed $COMPOSED1, exact $CACHED1"
[ -n "$ANSWER1" ] || fail "empty answer"
[ "$SOURCES1" -gt 0 ] || fail "no sources"
case "$ANSWER1" in *"$EXPECTED"*) log "the answer names $EXPECTED, as the bundled model does" ;;
                   *) log "note: the answer does not name $EXPECTED (the bundled model's usual answer)" ;; esac

# 4. The disk tier holds the entries; restart; the same query is served from the volume.
deadline=$((SECONDS + 60))
until [ "$(metric hypic_cache_bytes 'tier="disk"')" != 0 ]; do
    [ "$SECONDS" -lt "$deadline" ] || fail "the disk tier stayed empty"
    sleep 1
done
log "disk tier: $(metric hypic_cache_bytes 'tier="disk"') bytes"
[ "$(metric hypic_cache_redis_connected model_name)" = 1 ] || fail "the gateway is not connected to Redis at HYPIC_REDIS_URL"
deadline=$((SECONDS + 60))
until [ "$(metric hypic_cache_bytes 'tier="redis"')" != 0 ]; do  # written through, off the step loop
    [ "$SECONDS" -lt "$deadline" ] || fail "the Redis tier stayed empty"
    sleep 1
done
log "redis tier: $(metric hypic_cache_bytes 'tier="redis"') bytes shared; restarting the gateway container"
compose restart gateway
wait_healthy
HITS0="$(metric hypic_cache_hits_total 'tier="disk"')"
[ "$HITS0" = 0 ] || fail "disk hits before any query after the restart: $HITS0"
IFS=$'\t' read -r ANSWER2 SOURCES2 COMPOSED2 CACHED2 PROMPT2 < <(query)
HITS="$(metric hypic_cache_hits_total 'tier="disk"')"
log "warm:  answer '$ANSWER2'; $SOURCES2 sources; prompt $PROMPT2 tokens, composed $COMPOSED2, exact $CACHED2; disk hits $HITS"
[ "$HITS" -gt 0 ] || fail "no disk-tier hit after the restart: the cache volume did not survive"
[ "$COMPOSED2" -gt 0 ] || fail "composed_tokens is 0 after the restart"
[ "$ANSWER2" = "$ANSWER1" ] || fail "the answer changed after the restart: '$ANSWER1' -> '$ANSWER2'"

log "redis: $(docker inspect --format '{{.State.Health.Status}}' "$(compose ps -q redis)")"
log "PASS"
