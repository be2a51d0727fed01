#!/usr/bin/env bash
# Start, stop and check a 3-member etcd (v3.4 or newer) for elastic-rt's rendezvous,
# one member per host, over ssh (or on this machine with --local).
# See docs/deploy.md, "Bare metal". Run with --help for usage.
set -euo pipefail

PROG=${0##*/}
usage() {
    cat <<EOF
Usage: $PROG [options] start|stop|status|env HOST...

Runs one etcd member on each HOST (3 or 5 hosts; 1 for a throwaway test). The
member on a host is named etcd-HOST; it listens on HOST:CLIENT_PORT for clients
(the agents' --rdzv-endpoint) and HOST:PEER_PORT for the other members, and
keeps its data in DATA_ROOT/etcd-HOST (give the same HOSTs, in any order, to
every command).

Commands:
  start    start every member not already running, wait until the cluster is
           healthy, print the --rdzv-endpoint value for elastic-rt launch
  stop     stop every member (SIGTERM; data is kept)
  status   health of every member (exit 1 if any is unhealthy)
  env      print each member's settings as an etcd environment file, for
           launch/systemd/elastic-rt-etcd.service (/etc/elastic-rt/etcd.env)

Options:
  --local             run the members on this machine; HOSTs are local addresses
                      (e.g. 127.0.0.2 127.0.0.3 127.0.0.4) - for trying it out and tests
  --ssh CMD           how to reach a host (default: "ssh -o BatchMode=yes")
  --etcd PATH         etcd binary on the hosts (default: \$ETCD, else etcd on PATH)
  --data-root DIR     parent of the data directories (default: /var/lib/elastic-rt-etcd)
  --client-port N     client port (default: 2379)
  --peer-port N       peer port (default: 2380)
  --metrics-port N    /metrics and /health port, 0 for none (default: 2381)
  --token TOKEN       initial cluster token, unique per cluster (default: elastic-rt-etcd)
  --timeout S         seconds start waits for a healthy cluster (default: 60)
  -h, --help          this text

Example:
  $PROG start node1 node2 node3
  elastic-rt launch --rdzv-endpoint node1:2379,node2:2379,node3:2379 ...
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

LOCAL=0
SSH_CMD="ssh -o BatchMode=yes"
ETCD_BIN=${ETCD:-etcd}
DATA_ROOT=/var/lib/elastic-rt-etcd
CLIENT_PORT=2379
PEER_PORT=2380
METRICS_PORT=2381
TOKEN=elastic-rt-etcd
TIMEOUT=60

while [ $# -gt 0 ]; do
    case "$1" in
        --local) LOCAL=1; shift ;;
        --ssh) SSH_CMD=${2:?--ssh needs a value}; shift 2 ;;
        --etcd) ETCD_BIN=${2:?--etcd needs a value}; shift 2 ;;
        --data-root) DATA_ROOT=${2:?--data-root needs a value}; shift 2 ;;
        --client-port) CLIENT_PORT=${2:?--client-port needs a value}; shift 2 ;;
        --peer-port) PEER_PORT=${2:?--peer-port needs a value}; shift 2 ;;
        --metrics-port) METRICS_PORT=${2:?--metrics-port needs a value}; shift 2 ;;
        --token) TOKEN=${2:?--token needs a value}; shift 2 ;;
        --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { usage >&2; exit 2; }
COMMAND=$1; shift
HOSTS=("$@")

# Everything below ends up in a remote shell command line: allow only characters
# that need no quoting there.
safe() { [[ $2 =~ ^[A-Za-z0-9._:/@=,+-]+$ ]] || die "$1 '$2' has characters this script does not quote"; }
for n in CLIENT_PORT PEER_PORT METRICS_PORT TIMEOUT; do
    [[ ${!n} =~ ^[0-9]+$ ]] || die "--$(echo "$n" | tr 'A-Z_' 'a-z-') must be a number"
done
safe --etcd "$ETCD_BIN"; safe --data-root "$DATA_ROOT"; safe --token "$TOKEN"
case ${#HOSTS[@]} in
    1) log "warning: one member is no cluster: losing it loses every rendezvous" ;;
    3|5|7) ;;
    *) die "give 3 or 5 hosts (an odd number keeps a majority through failures), got ${#HOSTS[@]}" ;;
esac
for h in "${HOSTS[@]}"; do safe HOST "$h"; done
read -r -a SSH <<<"$SSH_CMD"

member_name() { echo "etcd-$(echo "$1" | tr -c 'A-Za-z0-9\n' '-')"; }

initial_cluster() {
    local h out=""
    for h in "${HOSTS[@]}"; do out+="${out:+,}$(member_name "$h")=http://$h:$PEER_PORT"; done
    echo "$out"
}

# The member's configuration as etcd environment variables (etcd reads ETCD_*).
member_env() {
    local h=$1 name
    name=$(member_name "$h")
    echo "ETCD_NAME=$name"
    echo "ETCD_DATA_DIR=$DATA_ROOT/$name"
    echo "ETCD_LISTEN_CLIENT_URLS=http://$h:$CLIENT_PORT"
    echo "ETCD_ADVERTISE_CLIENT_URLS=http://$h:$CLIENT_PORT"
    echo "ETCD_LISTEN_PEER_URLS=http://$h:$PEER_PORT"
    echo "ETCD_INITIAL_ADVERTISE_PEER_URLS=http://$h:$PEER_PORT"
    echo "ETCD_INITIAL_CLUSTER=$(initial_cluster)"
    echo "ETCD_INITIAL_CLUSTER_STATE=new"
    echo "ETCD_INITIAL_CLUSTER_TOKEN=$TOKEN"
    if [ "$METRICS_PORT" != 0 ]; then echo "ETCD_LISTEN_METRICS_URLS=http://$h:$METRICS_PORT"; fi
    echo "ETCD_AUTO_COMPACTION_MODE=periodic"
    echo "ETCD_AUTO_COMPACTION_RETENTION=1h"
}

# Run a shell command line on a host (or here, with --local).
on_host() {
    local h=$1 cmd=$2
    if [ "$LOCAL" = 1 ]; then
        sh -c "$cmd"
    else
        "${SSH[@]}" "$h" "$cmd"
    fi
}

start_member() {
    local h=$1 name dir env_args
    name=$(member_name "$h")
    dir="$DATA_ROOT"
    env_args=$(member_env "$h" | tr '\n' ' ')
    # Idempotent: a member whose pid file names a live process is left alone.
    # A restarted member finds its data directory and rejoins (the initial-cluster
    # settings are ignored then).
    on_host "$h" "mkdir -p $dir && \
if [ -f $dir/$name.pid ] && kill -0 \$(cat $dir/$name.pid) 2>/dev/null; then \
echo '$name already running'; else \
env $env_args nohup $ETCD_BIN </dev/null >>$dir/$name.log 2>&1 & echo \$! >$dir/$name.pid; \
echo \"$name started (log $dir/$name.log)\"; fi"
}

# SIGTERM one member; with wait=1, wait (10 s at most) for it to exit.
stop_member() {
    local h=$1 wait=$2 name pf
    name=$(member_name "$h")
    pf="$DATA_ROOT/$name.pid"
    if [ "$wait" = 0 ]; then
        on_host "$h" "if [ -f $pf ] && kill -TERM \$(cat $pf) 2>/dev/null; then echo '$name stopping'; \
else echo '$name not running'; fi"
    else
        on_host "$h" "if [ -f $pf ]; then i=0; \
while kill -0 \$(cat $pf) 2>/dev/null && [ \$i -lt 100 ]; do sleep 0.1; i=\$((i+1)); done; \
rm -f $pf; echo '$name stopped'; fi"
    fi
}

# 0 when the member answers /health with health true.
member_healthy() {
    curl -fsS --max-time 2 "http://$1:$CLIENT_PORT/health" 2>/dev/null | grep -q '"health":"true"'
}

endpoints() {
    local h out=""
    for h in "${HOSTS[@]}"; do out+="${out:+,}$h:$CLIENT_PORT"; done
    echo "$out"
}

case "$COMMAND" in
    start)
        command -v curl >/dev/null || die "curl is needed to check the members' health"
        for h in "${HOSTS[@]}"; do start_member "$h"; done
        deadline=$((SECONDS + TIMEOUT))
        for h in "${HOSTS[@]}"; do
            until member_healthy "$h"; do
                if [ $SECONDS -ge $deadline ]; then
                    die "etcd member on $h not healthy within ${TIMEOUT}s; see $DATA_ROOT/$(member_name "$h").log on $h"
                fi
                sleep 0.5
            done
        done
        log "cluster healthy: ${#HOSTS[@]} member(s)"
        echo "--rdzv-endpoint=$(endpoints)"
        ;;
    stop)
        # Signal every member first, then wait: members stop in parallel.
        for h in "${HOSTS[@]}"; do stop_member "$h" 0; done
        for h in "${HOSTS[@]}"; do stop_member "$h" 1; done
        ;;
    status)
        command -v curl >/dev/null || die "curl is needed to check the members' health"
        rc=0
        for h in "${HOSTS[@]}"; do
            if member_healthy "$h"; then echo "$h:$CLIENT_PORT healthy"; else echo "$h:$CLIENT_PORT UNHEALTHY"; rc=1; fi
        done
        exit $rc
        ;;
    env)
        for h in "${HOSTS[@]}"; do
            echo "# $h: /etc/elastic-rt/etcd.env"
            member_env "$h"
            echo
        done
        ;;
    *) die "unknown command '$COMMAND': start, stop, status or env" ;;
esac
