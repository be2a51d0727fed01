#!/usr/bin/env bash
# Certificates, keys and users for a TLS + auth etcd: the CA, one certificate per member,
# client certificates, and per-job users whose role reaches only their runs' keys.
# Used by launch/etcd-cluster.sh (bare metal) and by the etcd-pki Jobs in k8s/.
# See docs/etcd-security.md. Run with --help for usage.
set -euo pipefail

PROG=${0##*/}
usage() {
    cat <<EOF
Usage: $PROG [options] COMMAND [ARGS...]

Files go to DIR (--dir): keys are created 0600 and never leave it except where a
command says so. Every command keeps what already exists (run it again safely).

Commands:
  ca                    the CA: ca.pem, ca.key (ECDSA P-256, --ca-days)
  member NAME SAN...    a member's certificate, for clients and peers alike: NAME.pem,
                        NAME.key, CN etcd-member (the CN members run with in
                        --peer-cert-allowed-cn); SAN: the DNS names and IP addresses it
                        is reached at
  client USER           a client certificate with CN=USER: USER.pem, USER.key (etcd maps
                        the CN to the etcd user of that name when auth is on)
  jwt                   the key pair etcd signs auth tokens with: jwt.key, jwt.pub
  auth-enable           in etcd (--endpoints): user root with role root, then auth on.
                        etcdctl authenticates with the client certificate root.pem
                        (CN=root; made here if missing); root's password goes to
                        root.password, for emergencies only
  job-user USER [RUN_ID]
                        a job's identity: USER.pem/USER.key (client certificate),
                        USER.password (random), and in etcd a role USER with readwrite
                        on /elastic-rt/RUN_ID/ (default RUN_ID: USER) and the user USER
                        with that role and password; prints the --rdzv-conf value
  k8s-etcd              in a Kubernetes Job: make the CA, the members' certificate and
                        root's, store them as Secrets, wait for etcd, enable auth
  k8s-job-user JOB      in a Kubernetes Job: the user for the training Job JOB (its runs
                        are JOB_<uid>), stored as the Secret JOB-etcd

Options:
  -d, --dir DIR         where the files are (default: .)
  --endpoints URLS      etcd for auth-enable/job-user: https://HOST:PORT,... (default: \$ETCD_ENDPOINTS)
  --etcdctl PATH        etcdctl binary (default: \$ETCDCTL_BIN, else etcdctl on PATH)
  --runs-named PREFIX   job-user: grant every run whose id starts with PREFIX
                        (/elastic-rt/PREFIX) instead of one run id
  --ca-days N           CA validity (default: 3650)
  --days N              member and client certificate validity (default: 825)
  -h, --help            this text

Kubernetes (k8s-etcd, k8s-job-user) reads: POD_NAMESPACE, ETCD_STATEFULSET (etcd),
ETCD_PEER_SERVICE (etcd-peer), ETCD_CLIENT_SERVICE (etcd-client), ETCD_REPLICAS (3),
ETCD_WAIT_S (600: how long to wait for etcd), ETCD_ENDPOINTS (default: every member by its DNS name), PKI_SECRETS
(where k8s-job-user finds ca.pem, ca.key, root.pem, root.key; /etc/etcd-pki), KUBECTL.

Example (bare metal; launch/etcd-cluster.sh does this for you):
  $PROG -d pki ca
  $PROG -d pki member etcd1 etcd1.example.com 10.0.0.11
  $PROG -d pki --endpoints https://etcd1:2379 auth-enable
  $PROG -d pki --endpoints https://etcd1:2379 job-user job42
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

DIR=.
ENDPOINTS=${ETCD_ENDPOINTS:-}
ETCDCTL=${ETCDCTL_BIN:-etcdctl}
RUNS_NAMED=""
CA_DAYS=3650
DAYS=825

while [ $# -gt 0 ]; do
    case "$1" in
        --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
        -d|--dir) DIR=${2:?$1 needs a value}; shift 2 ;;
        --endpoints) ENDPOINTS=${2:?$1 needs a value}; shift 2 ;;
        --etcdctl) ETCDCTL=${2:?$1 needs a value}; shift 2 ;;
        --runs-named) RUNS_NAMED=${2:?$1 needs a value}; shift 2 ;;
        --ca-days) CA_DAYS=${2:?$1 needs a value}; shift 2 ;;
        --days) DAYS=${2:?$1 needs a value}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { usage >&2; exit 2; }
COMMAND=$1; shift
[[ $CA_DAYS =~ ^[0-9]+$ && $DAYS =~ ^[0-9]+$ ]] || die "--ca-days and --days must be numbers of days"
command -v openssl >/dev/null || die "openssl is needed (apt-get install openssl)"
umask 077
mkdir -p "$DIR"

MEMBER_CN=etcd-member

# A name used in file names, etcd users and roles: letters, digits, '.', '_', '-'.
check_name() { [[ $2 =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$ ]] || die "$1 '$2': use letters, digits, '.', '_' or '-'"; }

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

make_ca() {
    [ -s "$DIR/ca.pem" ] && [ -s "$DIR/ca.key" ] && return 0
    [ -e "$DIR/ca.pem" ] || [ -e "$DIR/ca.key" ] && die "$DIR has one of ca.pem/ca.key without the other; restore it or remove both"
    newkey "$DIR/ca.key"
    openssl req -x509 -new -key "$DIR/ca.key" -sha256 -days "$CA_DAYS" -subj "/CN=elastic-rt etcd CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$DIR/ca.pem" 2>/dev/null
    chmod 644 "$DIR/ca.pem"
    log "made the CA $DIR/ca.pem"
}

# sign NAME CN EXTENSIONS: NAME.key (kept if present) and NAME.pem signed by the CA.
sign() {
    local name=$1 cn=$2 ext=$3
    [ -s "$DIR/ca.key" ] || die "no CA in $DIR (run: $PROG -d $DIR ca)"
    [ -s "$DIR/$name.key" ] || newkey "$DIR/$name.key"
    printf '%s\n' "$ext" >"$DIR/$name.ext"
    openssl req -new -key "$DIR/$name.key" -subj "/CN=$cn" -out "$DIR/$name.csr" 2>/dev/null
    openssl x509 -req -in "$DIR/$name.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" -CAcreateserial \
        -days "$DAYS" -sha256 -extfile "$DIR/$name.ext" -out "$DIR/$name.pem" 2>/dev/null
    rm -f "$DIR/$name.csr" "$DIR/$name.ext"
    chmod 644 "$DIR/$name.pem"
}

make_member() {
    local name=$1 san="" s; shift
    check_name member "$name"
    [ $# -ge 1 ] || die "member $name: give the DNS names and IP addresses it is reached at"
    [ -s "$DIR/$name.pem" ] && return 0
    for s in "$@"; do
        if [[ $s =~ ^[0-9.]+$ || $s == *:* ]]; then san+="${san:+,}IP:$s"
        elif [[ $s =~ ^[A-Za-z0-9*]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]]; then san+="${san:+,}DNS:$s"
        else die "member $name: '$s' is neither a DNS name nor an IP address"
        fi
    done
    # Members present it to clients (serverAuth) and to each other as peers (both ways).
    sign "$name" "$MEMBER_CN" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san"
    log "made member certificate $DIR/$name.pem ($san)"
}

make_client() {
    check_name user "$1"
    [ -s "$DIR/$1.pem" ] && return 0
    sign "$1" "$1" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    log "made client certificate $DIR/$1.pem (CN=$1)"
}

make_jwt() {
    [ -s "$DIR/jwt.key" ] || newkey "$DIR/jwt.key"
    [ -s "$DIR/jwt.pub" ] || { openssl pkey -in "$DIR/jwt.key" -pubout -out "$DIR/jwt.pub" 2>/dev/null; chmod 644 "$DIR/jwt.pub"; }
}

make_password() {
    [ -s "$1" ] && return 0
    openssl rand -base64 33 | tr -d '/+=\n' >"$1"
}

# ---- etcd ----------------------------------------------------------------------
# etcdctl as root: authenticated by root's client certificate (etcd takes the CN as the user).
ctl() {
    [ -n "$ENDPOINTS" ] || die "give --endpoints https://HOST:PORT,... (or ETCD_ENDPOINTS)"
    command -v "$ETCDCTL" >/dev/null || die "etcdctl not found ($ETCDCTL); give --etcdctl PATH"
    "$ETCDCTL" --endpoints "$ENDPOINTS" --cacert "$DIR/ca.pem" --cert "$DIR/root.pem" --key "$DIR/root.key" \
        --dial-timeout 5s --command-timeout 10s "$@"
}

# ensure_user USER PASSWORD_FILE: the user exists with that password.
ensure_user() {
    if ctl user get "$1" >/dev/null 2>&1; then
        ctl user passwd "$1" --interactive=false <"$2" >/dev/null
    else
        ctl user add "$1" --interactive=false <"$2" >/dev/null
    fi
}

ensure_role_of() {
    local user=$1 role=$2
    ctl role get "$role" >/dev/null 2>&1 || ctl role add "$role" >/dev/null
    ctl user get "$user" | grep -q "^Roles:.* $role\( \|$\)" || ctl user grant-role "$user" "$role" >/dev/null
}

auth_enable() {
    make_client root
    make_password "$DIR/root.password"
    ensure_user root "$DIR/root.password"
    ensure_role_of root root
    ctl auth enable >/dev/null
    log "auth enabled at $ENDPOINTS (root authenticates with $DIR/root.pem)"
}

# job_user USER KEY_PREFIX: certificate, password, role with readwrite on KEY_PREFIX, user.
job_user() {
    local user=$1 prefix=$2
    check_name user "$user"
    case "$user" in root|"$MEMBER_CN") die "job-user: '$user' is not a job's name (root administers etcd, $MEMBER_CN are the members)" ;; esac
    make_client "$user"
    make_password "$DIR/$user.password"
    ensure_user "$user" "$DIR/$user.password"
    ctl role get "$user" >/dev/null 2>&1 || ctl role add "$user" >/dev/null
    ctl role grant-permission "$user" --prefix=true readwrite "$prefix" >/dev/null
    ensure_role_of "$user" "$user"
    log "user $user may read and write $prefix* only"
}

key_prefix() {
    if [ -n "$RUNS_NAMED" ]; then
        check_name --runs-named "$RUNS_NAMED"
        echo "/elastic-rt/$RUNS_NAMED"
    else
        check_name "run id" "$1"
        echo "/elastic-rt/$1/"
    fi
}

# ---- Kubernetes ----------------------------------------------------------------
KUBECTL=${KUBECTL:-kubectl}
WAIT_S=${ETCD_WAIT_S:-600}
[[ $WAIT_S =~ ^[0-9]+$ ]] || die "ETCD_WAIT_S must be a number of seconds"

secret_exists() { "$KUBECTL" get secret "$1" -o name >/dev/null 2>&1; }

# put_secret NAME KEY=FILE...: create or update the Secret.
put_secret() {
    local name=$1 kv args=(); shift
    for kv in "$@"; do args+=(--from-file="$kv"); done
    "$KUBECTL" create secret generic "$name" "${args[@]}" --dry-run=client -o yaml | "$KUBECTL" apply -f - >/dev/null
    log "stored Secret $name"
}

# secret_file NAME KEY FILE: one key of a Secret into FILE.
secret_file() {
    "$KUBECTL" get secret "$1" -o "jsonpath={.data.$2}" | openssl base64 -d -A >"$3"
    [ -s "$3" ] || die "Secret $1 has no key $2"
}

k8s_etcd() {
    local ns=${POD_NAMESPACE:?POD_NAMESPACE must be set (downward API)} sts=${ETCD_STATEFULSET:-etcd}
    local peer=${ETCD_PEER_SERVICE:-etcd-peer} client=${ETCD_CLIENT_SERVICE:-etcd-client} n=${ETCD_REPLICAS:-3}
    local i sans=() have=0 s
    [[ $n =~ ^[0-9]+$ ]] || die "ETCD_REPLICAS must be a number"
    for s in etcd-ca etcd-tls etcd-root; do secret_exists "$s" && have=$((have + 1)); done
    if [ "$have" = 0 ]; then
        for ((i = 0; i < n; i++)); do
            sans+=("$sts-$i.$peer.$ns.svc" "$sts-$i.$peer.$ns.svc.cluster.local" "$sts-$i.$peer" "$sts-$i.$peer.$ns")
        done
        sans+=("$client" "$client.$ns" "$client.$ns.svc" "$client.$ns.svc.cluster.local" localhost 127.0.0.1 ::1)
        make_ca
        make_member server "${sans[@]}"
        make_client root
        make_password "$DIR/root.password"
        make_jwt
        put_secret etcd-ca ca.pem="$DIR/ca.pem" ca.key="$DIR/ca.key"
        put_secret etcd-root ca.pem="$DIR/ca.pem" root.pem="$DIR/root.pem" root.key="$DIR/root.key" \
            root.password="$DIR/root.password"
        # Last: the members wait for this one, and find the others made.
        put_secret etcd-tls ca.pem="$DIR/ca.pem" server.pem="$DIR/server.pem" server.key="$DIR/server.key" \
            jwt.key="$DIR/jwt.key" jwt.pub="$DIR/jwt.pub"
    elif [ "$have" = 3 ]; then
        log "Secrets etcd-ca, etcd-tls and etcd-root exist: keeping them"
        secret_file etcd-root ca.pem "$DIR/ca.pem"
        secret_file etcd-root root.pem "$DIR/root.pem"
        secret_file etcd-root root.key "$DIR/root.key"
        secret_file etcd-root root.password "$DIR/root.password"
    else
        die "only $have of the Secrets etcd-ca, etcd-tls, etcd-root exist; delete them all to start over (this re-keys etcd)"
    fi
    if [ -z "$ENDPOINTS" ]; then
        for ((i = 0; i < n; i++)); do ENDPOINTS+="${ENDPOINTS:+,}https://$sts-$i.$peer.$ns.svc:2379"; done
    fi
    wait_healthy "$WAIT_S"
    auth_enable
}

# Wait until every endpoint answers (members still starting, images still pulling).
wait_healthy() {
    local deadline=$((SECONDS + $1))
    log "waiting up to ${1}s for etcd at $ENDPOINTS"
    until ctl endpoint health >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "etcd at $ENDPOINTS not healthy within ${1}s"
        sleep 2
    done
}

k8s_job_user() {
    local job=$1 secret
    check_name "Job name" "$job"
    secret="$job-etcd"
    local from=${PKI_SECRETS:-/etc/etcd-pki} f
    [ -n "$ENDPOINTS" ] || die "ETCD_ENDPOINTS must be set (https://etcd-0.etcd-peer:2379,...)"
    for f in ca.pem ca.key root.pem root.key; do
        [ -s "$from/$f" ] || die "$from/$f is missing: mount the Secrets etcd-ca and etcd-root at $from"
        cp "$from/$f" "$DIR/$f"
    done
    if secret_exists "$secret"; then
        # A re-run (Job retry) keeps the password that running agents hold.
        secret_file "$secret" password "$DIR/$job.password"
        secret_file "$secret" client.pem "$DIR/$job.pem"
        secret_file "$secret" client.key "$DIR/$job.key"
    fi
    wait_healthy "$WAIT_S"
    RUNS_NAMED="${job}_"
    job_user "$job" "$(key_prefix "")"
    put_secret "$secret" ca.pem="$DIR/ca.pem" client.pem="$DIR/$job.pem" client.key="$DIR/$job.key" \
        password="$DIR/$job.password"
}

case "$COMMAND" in
    ca) make_ca ;;
    member) [ $# -ge 1 ] || die "member: give NAME and its SANs"; make_member "$@" ;;
    client) [ $# -eq 1 ] || die "client: give one USER"; make_client "$1" ;;
    jwt) make_jwt ;;
    auth-enable) auth_enable ;;
    job-user)
        case $# in 1|2) ;; *) die "job-user: give USER [RUN_ID]" ;; esac
        prefix=$(key_prefix "${2:-$1}")
        job_user "$1" "$prefix"
        echo "ca_cert=$DIR/ca.pem,cert=$DIR/$1.pem,key=$DIR/$1.key,user=$1,password_file=$DIR/$1.password"
        ;;
    k8s-etcd) k8s_etcd ;;
    k8s-job-user) [ $# -eq 1 ] || die "k8s-job-user: give the training Job's name"; k8s_job_user "$1" ;;
    *) die "unknown command '$COMMAND' (see --help)" ;;
esac
