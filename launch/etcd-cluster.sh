#!/usr/bin/env bash
# Start, stop and check a 3-member etcd (v3.4 or newer) for elastic-rt's rendezvous,
# one member per host, over ssh (or on this machine with --local): TLS with client
# certificates and auth, a user per job (launch/etcd-pki.sh makes the keys).
# See docs/deploy.md, "Bare metal". Run with --help for usage.
set -euo pipefail

PROG=${0##*/}
usage() {
    cat <<EOF
Usage: $PROG [options] start|stop|status|env|certs|auth HOST...
       $PROG [options] job-user HOST... -- RUN_ID

Runs one etcd member on each HOST (3 or 5 hosts; 1 for a throwaway test). The
member on a host is named etcd-HOST; it listens on HOST:CLIENT_PORT for clients
(the agents' --rdzv-endpoint) and HOST:PEER_PORT for the other members, and
keeps its data in DATA_ROOT/etcd-HOST (give the same HOSTs, in any order, to
every command).

Clients and peers speak TLS and must present a certificate signed by the CA in
PKI_DIR (made there on first use, with each member's certificate; the member's
files are copied to DATA_ROOT/pki on its host). Auth is on: root authenticates
with PKI_DIR/root.pem; each job gets a user whose role reaches its own run's
keys only (job-user). --insecure-plaintext turns all of it off, for tries.

Commands:
  start    start every member not already running, wait until the cluster is
           healthy, print the --rdzv-endpoint value for elastic-rt launch
  stop     stop every member (SIGTERM; data is kept)
  status   health of every member (exit 1 if any is unhealthy)
  env      print each member's settings as an etcd environment file, for
           launch/systemd/elastic-rt-etcd.service (/etc/elastic-rt/etcd.env)
  certs    make the members' certificates and copy them to their hosts
           (start does it too; for the systemd unit)
  auth     once the members run: user root and auth on (start does it too;
           for the systemd unit)
  job-user make the user for run RUN_ID: a client certificate, a password and
           a role with readwrite on /elastic-rt/RUN_ID/ only, in PKI_DIR; prints
           the --rdzv-endpoint and --rdzv-conf of the job's agents (copy
           PKI_DIR/ca.pem and PKI_DIR/RUN_ID.{pem,key,password} to the job's hosts)

Options:
  --local             run the members on this machine; HOSTs are local addresses
                      (e.g. 127.0.0.2 127.0.0.3 127.0.0.4) - for trying it out and tests
  --ssh CMD           how to reach a host (default: "ssh -o BatchMode=yes")
  --etcd PATH         etcd binary on the hosts (default: \$ETCD, else etcd on PATH)
  --etcdctl PATH      etcdctl here, for auth and users (default: \$ETCDCTL_BIN, else
                      etcdctl on PATH)
  --pki DIR           the CA, certificates and job credentials, on this machine
                      (default: \${XDG_CONFIG_HOME:-~/.config}/elastic-rt/etcd-pki)
  --insecure-plaintext
                      no TLS, no auth: anyone who reaches the client port can end
                      or hijack any job. For a first try on a private machine only
  --data-root DIR     parent of the data directories (default: /var/lib/elastic-rt-etcd)
  --client-port N     client port (default: 2379)
  --peer-port N       peer port (default: 2380)
  --metrics-port N    /metrics and /health port, 0 for none (default: 2381)
  --token TOKEN       initial cluster token, unique per cluster (default: elastic-rt-etcd)
  --timeout S         seconds start waits for a healthy cluster (default: 60)
  -h, --help          this text

Example:
  $PROG start node1 node2 node3
  $PROG job-user node1 node2 node3 -- job42
  elastic-rt launch --rdzv-endpoint https://node1:2379,https://node2:2379,https://node3:2379 \\
      --rdzv-id job42 --rdzv-conf ca_cert=...,cert=...,key=...,user=job42,password_file=... ...
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

LOCAL=0
SSH_CMD="ssh -o BatchMode=yes"
ETCD_BIN=${ETCD:-etcd}
ETCDCTL_BIN=${ETCDCTL_BIN:-etcdctl}
PKI_DIR=${XDG_CONFIG_HOME:-$HOME/.config}/elastic-rt/etcd-pki
PLAINTEXT=0
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
        --etcdctl) ETCDCTL_BIN=${2:?--etcdctl needs a value}; shift 2 ;;
        --pki) PKI_DIR=${2:?--pki needs a value}; shift 2 ;;
        --insecure-plaintext) PLAINTEXT=1; shift ;;
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
HOSTS=()
RUN_ID=""
while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then RUN_ID=${2:-}; break; fi
    HOSTS+=("$1"); shift
done

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
PKI_SH="$(dirname "$0")/etcd-pki.sh"
if [ "$PLAINTEXT" = 1 ]; then
    SCHEME=http
    log "warning: --insecure-plaintext: no TLS and no auth; whoever reaches port $CLIENT_PORT can end or hijack any job"
else
    SCHEME=https
fi
# The member's files on its host (copied there from PKI_DIR by certs/start).
HOST_PKI="$DATA_ROOT/pki"

member_name() { echo "etcd-$(echo "$1" | tr -c 'A-Za-z0-9\n' '-')"; }

initial_cluster() {
    local h out=""
    for h in "${HOSTS[@]}"; do out+="${out:+,}$(member_name "$h")=$SCHEME://$h:$PEER_PORT"; done
    echo "$out"
}

# The member's configuration as etcd environment variables (etcd reads ETCD_*).
member_env() {
    local h=$1 name
    name=$(member_name "$h")
    echo "ETCD_NAME=$name"
    echo "ETCD_DATA_DIR=$DATA_ROOT/$name"
    echo "ETCD_LISTEN_CLIENT_URLS=$SCHEME://$h:$CLIENT_PORT"
    echo "ETCD_ADVERTISE_CLIENT_URLS=$SCHEME://$h:$CLIENT_PORT"
    echo "ETCD_LISTEN_PEER_URLS=$SCHEME://$h:$PEER_PORT"
    echo "ETCD_INITIAL_ADVERTISE_PEER_URLS=$SCHEME://$h:$PEER_PORT"
    echo "ETCD_INITIAL_CLUSTER=$(initial_cluster)"
    echo "ETCD_INITIAL_CLUSTER_STATE=new"
    echo "ETCD_INITIAL_CLUSTER_TOKEN=$TOKEN"
    if [ "$METRICS_PORT" != 0 ]; then echo "ETCD_LISTEN_METRICS_URLS=http://$h:$METRICS_PORT"; fi
    echo "ETCD_AUTO_COMPACTION_MODE=periodic"
    echo "ETCD_AUTO_COMPACTION_RETENTION=1h"
    [ "$PLAINTEXT" = 1 ] && return 0
    # Clients and peers: TLS and a certificate signed by the CA; peers only as CN etcd-member
    # (a job's client certificate, signed by the same CA, cannot pose as a member).
    local d="$HOST_PKI/$name"
    echo "ETCD_CERT_FILE=$d/member.pem"
    echo "ETCD_KEY_FILE=$d/member.key"
    echo "ETCD_TRUSTED_CA_FILE=$d/ca.pem"
    echo "ETCD_CLIENT_CERT_AUTH=true"
    echo "ETCD_PEER_CERT_FILE=$d/member.pem"
    echo "ETCD_PEER_KEY_FILE=$d/member.key"
    echo "ETCD_PEER_TRUSTED_CA_FILE=$d/ca.pem"
    echo "ETCD_PEER_CLIENT_CERT_AUTH=true"
    echo "ETCD_PEER_CERT_ALLOWED_CN=etcd-member"
    # Signed, expiring auth tokens that every member accepts.
    echo "ETCD_AUTH_TOKEN=jwt,pub-key=$d/jwt.pub,priv-key=$d/jwt.key,sign-method=ES256,ttl=10m"
}

pki() { "$PKI_SH" --dir "$PKI_DIR" --etcdctl "$ETCDCTL_BIN" --endpoints "$(endpoints)" "$@"; }

# Make each member's certificate and copy its files to DATA_ROOT/pki/NAME on its host: the CA
# certificate, its own certificate and key, the token signing key pair. The certificate names
# HOST: clients check it, and members check that a peer connects from an address it names (with
# --local every member connects from 127.0.0.1, which it names too).
install_certs() {
    local h name d f
    pki ca
    pki jwt
    for h in "${HOSTS[@]}"; do
        name=$(member_name "$h")
        if [ "$LOCAL" = 1 ]; then pki member "$name" "$h" 127.0.0.1; else pki member "$name" "$h"; fi
        d="$HOST_PKI/$name"
        on_host "$h" "umask 077 && mkdir -p $d"
        for f in ca.pem:ca.pem "$name.pem:member.pem" "$name.key:member.key" jwt.key:jwt.key jwt.pub:jwt.pub; do
            on_host "$h" "umask 077 && cat >$d/${f#*:}" <"$PKI_DIR/${f%%:*}"
        done
    done
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

# 0 when the member answers /health with health true: on the metrics port (plain HTTP), else
# on the client port (with root's client certificate over TLS).
member_healthy() {
    if [ "$METRICS_PORT" != 0 ]; then
        curl -fsS --max-time 2 "http://$1:$METRICS_PORT/health" 2>/dev/null | grep -q '"health":"true"'
    elif [ "$PLAINTEXT" = 1 ]; then
        curl -fsS --max-time 2 "http://$1:$CLIENT_PORT/health" 2>/dev/null | grep -q '"health":"true"'
    else
        curl -fsS --max-time 2 --cacert "$PKI_DIR/ca.pem" --cert "$PKI_DIR/root.pem" --key "$PKI_DIR/root.key" \
            "https://$1:$CLIENT_PORT/health" 2>/dev/null | grep -q '"health":"true"'
    fi
}

endpoints() {
    local h out=""
    for h in "${HOSTS[@]}"; do out+="${out:+,}$SCHEME://$h:$CLIENT_PORT"; done
    echo "$out"
}

case "$COMMAND" in
    start)
        command -v curl >/dev/null || die "curl is needed to check the members' health"
        if [ "$PLAINTEXT" = 0 ]; then
            install_certs
            pki client root  # for the health checks; auth-enable makes the user
        fi
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
        [ "$PLAINTEXT" = 1 ] || pki auth-enable
        log "cluster healthy: ${#HOSTS[@]} member(s)"
        echo "--rdzv-endpoint=$(endpoints)"
        ;;
    certs)
        [ "$PLAINTEXT" = 0 ] || die "certs: --insecure-plaintext uses none"
        install_certs
        ;;
    auth)
        [ "$PLAINTEXT" = 0 ] || die "auth: --insecure-plaintext has none"
        pki auth-enable
        ;;
    job-user)
        [ "$PLAINTEXT" = 0 ] || die "job-user: --insecure-plaintext has no users"
        [ -n "$RUN_ID" ] || die "job-user: give the run id after --: job-user HOST... -- RUN_ID"
        conf=$(pki job-user "$RUN_ID")
        echo "--rdzv-endpoint=$(endpoints)"
        echo "--rdzv-conf=$conf"
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
    *) die "unknown command '$COMMAND': start, stop, status, env, certs, auth or job-user" ;;
esac
