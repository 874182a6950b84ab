#!/usr/bin/env bash
# End-to-end check of the Compose deployment on a real Docker daemon (docs/deploy.md):
#   1. builds the images (gateway, redis) on a local base image (docker/build-base.sh), no registry needed;
#   2. starts the stack with Compose: `ingest` ingests a documents directory (the demo corpus, the project's
#      own docs, mounted the way your own documents are), then the gateway serves the image's default model
#      (the real-language hybrid tuned for reuse, smollm2-hybrid-135m-reuse, assembled into the volume on first start);
#   3. waits for the gateway's healthcheck, asks POST /query a question of README.md and checks that the
#      answer is real English naming what README.md says (EXPECTED), with sources, and that the native decode
#      kernels built into the image ran it (the gateway's log and GET /health: no fallback to torch's ops);
#   4. teams: the stack runs with three keys: HYPIC_API_KEY (the operator's, tenant `default`, which owns what
#      `ingest` loaded: the demo corpus) and HYPIC_API_KEYS (team-a, team-b). The operator shares the demo corpus
#      as the collection `demo` (HYPIC_SHARED_COLLECTIONS, filled with `hypic ingest --index-dir` in the running
#      container, docs/deploy.md "Teams"); team A uploads a document into its own collection, team B can neither
#      list, read, delete, search nor be answered from it, both get answers from `demo`, a request without a key
#      is a 401, and team A's delete removes the document;
#   5. waits for the segment cache's disk tier, restarts the gateway container and asks again: the answer
#      must come from the cache volume (hypic_cache_hits_total{tier="disk"} > 0, composed_tokens > 0), unchanged;
#   6. `down -v` (also on failure, after printing the logs).
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
# Signs the Redis tier's entries; compose.yaml requires it for every command, `build` and `down` included.
export HYPIC_CACHE_SECRET="${HYPIC_CACHE_SECRET:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}"
CORPUS=data/docs_corpus.jsonl   # the default model's demo corpus (app/service/settings/retrieval.py)
KERNELS_DIR=/opt/hypic/kernels   # where the image keeps its native kernels (docker/Dockerfile, HYPIC_KERNELS_DIR)
# One of README.md's example questions, asked as README.md checked it (top_k 3, greedy, max_tokens 24), and a word
# of the answer README.md gives (compared case-insensitively).
QUESTION="Under which license is the project released?"
EXPECTED="Apache"
TOP_K=3
MAX_TOKENS=24

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
        # The classic builder leaves docker/Dockerfile's build stages as untagged images; BuildKit leaves none.
        docker image prune -f --filter label=org.hypic-gateway.stage=deps >/dev/null 2>&1 || true
        docker image prune -f --filter label=org.hypic-gateway.stage=kernels >/dev/null 2>&1 || true
        docker image prune -f --filter label=org.hypic-gateway.stage=source >/dev/null 2>&1 || true
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

# 2. The stack, with the demo corpus (the project's docs) as "your documents", serving the image's default model.
mkdir -p "$WORK/documents"
cp "$CORPUS" "$WORK/documents/"
chmod 755 "$WORK" "$WORK/documents"
chmod 644 "$WORK/documents/$(basename "$CORPUS")"
export HYPIC_DOCUMENTS="$WORK/documents"
unset HYPIC_MODEL HYPIC_MODELS  # the defaults: the image's model, docker/models/ (empty) as "your models"
export HYPIC_PORT="$PORT" HYPIC_BIND=127.0.0.1
# Teams: the operator's key opens the tenant `default`; team-a and team-b have a key each and collections of their own.
random_key() { printf '%s-%s' "$1" "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"; }
OP_KEY="$(random_key op)" A_KEY="$(random_key a)" B_KEY="$(random_key b)"
export HYPIC_API_KEY="$OP_KEY" HYPIC_API_KEYS="{\"$A_KEY\": \"team-a\", \"$B_KEY\": \"team-b\"}"
export HYPIC_SHARED_COLLECTIONS='{"demo": []}'  # read by every tenant, written by none through the API
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

api() {  # api KEY METHOD PATH [JSON BODY]: prints the HTTP status; the reply's body is in $WORK/body.json
    local args=(-sS -o "$WORK/body.json" -w '%{http_code}' -X "$2" "$URL$3")
    [ -z "$1" ] || args+=(-H "Authorization: Bearer $1")
    [ -z "${4:-}" ] || args+=(-H 'content-type: application/json' --data "$4")
    curl "${args[@]}" || fail "$2 $3: no answer"
}
expect() {  # expect STATUS KEY METHOD PATH [JSON BODY]: fails unless the gateway answers STATUS
    local status
    status="$(api "${@:2}")"
    [ "$status" = "$1" ] || fail "$3 $4 answered $status, expected $1: $(head -c 400 "$WORK/body.json")"
}
field() {  # field PYTHON-EXPRESSION: evaluated on the last reply's JSON (r)
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$WORK/body.json" "$1"
}
query() {  # query KEY [COLLECTIONS JSON] [QUESTION] [MAX_TOKENS]: prints answer <TAB> sources <TAB> composed_tokens <TAB>
           # cached_tokens <TAB> prompt_tokens <TAB> the sources' collection/document ids (comma-separated)
    expect 200 "$1" POST /query "{\"question\": \"${3:-$QUESTION}\", \"top_k\": $TOP_K, \"max_tokens\": ${4:-$MAX_TOKENS}${2:+, \"collections\": $2}}"
    python3 - "$WORK/body.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
u = r["usage"]
docs = ",".join(sorted({f"{s['collection']}/{s['document_id']}" for s in r["sources"]}))
print("\t".join(map(str, [r["answer"].strip().replace("\t", " ").replace("\n", " "), len(r["sources"]),
                          u["composed_tokens"], u["cached_tokens"], u["prompt_tokens"], docs or "-"])))
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

# 3. A first (cold) query, with the operator's key (the tenant `default`, which owns the ingested documents).
query "$OP_KEY" > "$WORK/q.tsv"
IFS=$'\t' read -r ANSWER1 SOURCES1 COMPOSED1 CACHED1 PROMPT1 _ < "$WORK/q.tsv"
log "cold:  answer '$ANSWER1'; $SOURCES1 sources; prompt $PROMPT1 tokens, composed $COMPOSED1, exact $CACHED1"
[ -n "$ANSWER1" ] || fail "empty answer"
[ "$SOURCES1" -gt 0 ] || fail "no sources"
python3 - "$ANSWER1" "$EXPECTED" <<'EOF' || fail "the default model's answer is not README.md's: '$ANSWER1' (expected '$EXPECTED' in it)"
import re, sys
answer, expected = sys.argv[1], sys.argv[2]
words = re.findall(r"[A-Za-z]+", answer)
# real English: mostly words of letters (not ids or digits), and README.md's word in it
assert len(words) >= 2 and sum(map(len, words)) >= 0.6 * len(answer.replace(" ", "")), answer
assert expected.lower() in answer.lower(), answer
EOF
log "the answer names '$EXPECTED', as README.md's answer does"

# The native decode step: the gateway's log names the kernel variant it loaded from the image's kernels
# directory (HYPIC_KERNELS_DIR), and no fallback to torch's ops; GET /health says the same.
compose logs --no-color gateway > "$WORK/gateway.log"
KERNELS_LINE="$(grep -a 'decode kernels: variant' "$WORK/gateway.log" | tail -n 1 | grep -ao 'decode kernels: variant [^"]*')" \
    || fail "the gateway's log does not show the native decode kernels loaded"
! grep -a 'decode kernels unavailable' "$WORK/gateway.log" || fail "the gateway fell back to torch's ops (above)"
case "$KERNELS_LINE" in *" from $KERNELS_DIR/"*) ;; *) fail "kernels not loaded from the image's $KERNELS_DIR: $KERNELS_LINE" ;; esac
curl -fsS "$URL/health" > "$WORK/health.json" || fail "GET /health"
KERNELS_HEALTH="$(python3 - "$WORK/health.json" <<'EOF'
import json, sys
def find(o):  # the kernels' status in /health: {"state": ..., "variant": ..., ...}
    if isinstance(o, dict):
        if "state" in o and "variant" in o:
            return o
        return next((f for f in map(find, o.values()) if f is not None), None)
    return None
k = find(json.load(open(sys.argv[1])))
print("none" if k is None else f"{k['state']} {k['variant']} {k.get('library')}")
EOF
)"
case "$KERNELS_HEALTH" in "loaded "*" $KERNELS_DIR/"*) ;; *) fail "GET /health: kernels '$KERNELS_HEALTH', expected loaded from $KERNELS_DIR" ;; esac
log "native decode step: $KERNELS_LINE; /health: $KERNELS_HEALTH"

# 4. Teams. Who owns the demo corpus: the tenant `default` (ingest wrote it to HYPIC_INDEX_DIR, that tenant's
# collection `default`); team-a and team-b start with nothing, so the operator shares it as the collection `demo`.
expect 401 "" POST /query "{\"question\": \"$QUESTION\"}"
log "teams: a request without a key: 401 ($(field 'r["error"]["message"]'))"
expect 401 "not-a-key" GET /documents
log "teams: an unknown key: 401"
expect 200 "$A_KEY" GET /documents
[ "$(field 'len(r["data"])')" = 0 ] || fail "team-a sees documents in its 'default' collection: $(head -c 300 "$WORK/body.json")"
expect 200 "$OP_KEY" GET "/documents?limit=1000"
log "teams: the demo corpus belongs to the tenant 'default' (the operator's HYPIC_API_KEY: $(field 'len(r["data"])') documents" \
    "in its collection 'default', written by the ingest service); team-a's and team-b's 'default' collections are empty"
compose exec -T gateway hypic ingest --index-dir /var/lib/hypic/collections/_shared/demo /documents 2>&1 | tail -n 1 | sed 's/^/    /'
expect 200 "$B_KEY" GET /collections
log "teams: the operator shares it as the collection 'demo' (HYPIC_SHARED_COLLECTIONS='$HYPIC_SHARED_COLLECTIONS', filled by" \
    "hypic ingest --index-dir /var/lib/hypic/collections/_shared/demo); team-b reads: $(field '", ".join("%s (%d documents, %s)" % (c["name"], c["documents"], "shared" if c["shared"] else "its own") for c in r["data"])')"
expect 403 "$A_KEY" POST "/documents?collection=demo" '{"id": "graffiti", "text": "Seinaim is based in Paris."}'
log "teams: team-a cannot write the shared collection: 403"

SECRET_Q="What is the vault code of Brill?"
SECRET="The vault code of Brill is 4417. Tam Oke keeps the key of the vault in the cafe by the bridge."
expect 201 "$A_KEY" POST "/documents?collection=vault" "{\"id\": \"brill-vault\", \"title\": \"Brill\", \"text\": \"$SECRET\"}"
log "teams: team-a uploaded brill-vault into its own collection 'vault' ($(field 'r["chunks"]') chunk)"
query "$A_KEY" '["vault"]' "$SECRET_Q" 8 > "$WORK/q.tsv"   # the checks below read the sources, not the answer
IFS=$'\t' read -r ANSWER _ _ _ _ DOCS < "$WORK/q.tsv"
[ "$DOCS" = vault/brill-vault ] || fail "team-a's query over 'vault' had the sources $DOCS"
log "teams: team-a's query over 'vault' is answered from it: '$ANSWER'; sources $DOCS"
expect 200 "$B_KEY" GET /collections
case "$(field '[c["name"] for c in r["data"]]')" in *vault*) fail "team-b lists team-a's collection: $(cat "$WORK/body.json")" ;; esac
expect 400 "$B_KEY" GET "/documents?collection=vault"
expect 400 "$B_KEY" GET "/documents/brill-vault?collection=vault"
expect 404 "$B_KEY" GET "/documents/brill-vault"
expect 400 "$B_KEY" DELETE "/documents/brill-vault?collection=vault"
expect 400 "$B_KEY" POST /search '{"query": "vault code of Brill", "collections": ["vault"]}'
expect 400 "$B_KEY" POST /query "{\"question\": \"$SECRET_Q\", \"collections\": [\"vault\"]}"
log "teams: team-b cannot list, read, delete, search or query team-a's collection (each a 4xx: $(field 'r["error"]["message"]'))"
for collections in "" '["demo"]' '["default", "demo"]'; do
    query "$B_KEY" "$collections" "$SECRET_Q" 8 > "$WORK/q.tsv"
    IFS=$'\t' read -r ANSWER _ _ _ _ DOCS < "$WORK/q.tsv"
    case "$DOCS $ANSWER" in *brill-vault*|*4417*) fail "team-b was answered from team-a's document: '$ANSWER' ($DOCS)" ;; esac
done
expect 200 "$B_KEY" POST /search '{"query": "vault code of Brill 4417", "collections": ["default", "demo"], "top_k": 8}'
[ "$(field 'any(d["document_id"] == "brill-vault" or "4417" in d["text"] for d in r["data"])')" = False ] \
    || fail "team-b's search found team-a's document: $(head -c 400 "$WORK/body.json")"
log "teams: team-b's queries and searches over its own and the shared collections never show team-a's document"
for team in a b; do
    key="$A_KEY"; [ "$team" = a ] || key="$B_KEY"
    query "$key" '["demo"]' "" 8 > "$WORK/q.tsv"
    IFS=$'\t' read -r ANSWER SOURCES _ _ _ DOCS < "$WORK/q.tsv"
    [ "$SOURCES" -gt 0 ] || fail "team-$team: no sources from the shared demo corpus"
    [ -z "$(printf '%s' "$DOCS" | tr ',' '\n' | grep -v '^demo/')" ] || fail "team-$team: sources not from 'demo': $DOCS"
    log "teams: team-$team over 'demo': answer '$ANSWER'; $SOURCES sources, all from 'demo'"
done
expect 200 "$A_KEY" DELETE "/documents/brill-vault?collection=vault"
expect 404 "$A_KEY" GET "/documents/brill-vault?collection=vault"
# Its query stored the chunk's entry in every tier; the delete removes them (the gateway logs how many per tier).
FORGOTTEN="$(compose logs --no-color gateway | grep -a "brill-vault" | grep -ao "cache entries removed {[^}]*}" | tail -n 1)"
case "$FORGOTTEN" in *"'disk': 0"*|*"'redis': 0"*|"") fail "the delete left cache entries in a stored tier: '$FORGOTTEN'" ;; esac
log "teams: team-a deleted brill-vault; it is gone (404), and so is its cache: $FORGOTTEN"

# 5. The disk tier holds the entries; restart; the same query is served from the volume.
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
query "$OP_KEY" > "$WORK/q.tsv"
IFS=$'\t' read -r ANSWER2 SOURCES2 COMPOSED2 CACHED2 PROMPT2 _ < "$WORK/q.tsv"
HITS="$(metric hypic_cache_hits_total 'tier="disk"')"
log "warm:  answer '$ANSWER2'; $SOURCES2 sources; prompt $PROMPT2 tokens, composed $COMPOSED2, exact $CACHED2; disk hits $HITS"
[ "$HITS" -gt 0 ] || fail "no disk-tier hit after the restart: the cache volume did not survive"
[ "$COMPOSED2" -gt 0 ] || fail "composed_tokens is 0 after the restart"
[ "$ANSWER2" = "$ANSWER1" ] || fail "the answer changed after the restart: '$ANSWER1' -> '$ANSWER2'"

log "redis: $(docker inspect --format '{{.State.Health.Status}}' "$(compose ps -q redis)")"
log "PASS"
