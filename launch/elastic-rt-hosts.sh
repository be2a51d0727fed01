#!/usr/bin/env bash
# Run `elastic-rt launch` on every host of a hostfile (over ssh, pdsh, or as local
# processes), one log per host; drain one host's agent or stop them all.
# See docs/deploy.md, "Bare metal". Run with --help for usage.
set -euo pipefail

PROG=${0##*/}
usage() {
    cat <<EOF
Usage: $PROG [options] run [--] LAUNCH_OPTIONS... SCRIPT [SCRIPT_ARGS...]
       $PROG [options] --rdzv-id ID drain HOST...
       $PROG [options] --rdzv-id ID stop
       $PROG [options] --rdzv-id ID status

run     starts \`elastic-rt launch --node-id HOST --local-addr ADDR LAUNCH_OPTIONS...
        SCRIPT SCRIPT_ARGS...\` on every host at once and waits for all of them.
        LAUNCH_OPTIONS are the same on every host and must include --rdzv-id,
        --rdzv-endpoint and --nnodes MIN:MAX. Each host's output goes to
        LOG_DIR/HOST.log. Ctrl-C (or SIGTERM) stops every agent gracefully.
        %h in any argument is replaced by the host, e.g. --log-dir=/var/log/job/%h.
        To add a host to a running job, run the same command with only the new
        host (-H newhost): it joins at the next round if the job has room (MAX).
drain   sends SIGTERM to the agent on each HOST and waits for it to exit: its
        workers get --grace-period seconds to finish (checkpoint), it leaves the
        rendezvous, and the other hosts go on without it if at least MIN remain.
stop    drains every host of the hostfile.
status  says which hosts run an agent of the job.

Each host keeps the agent's pid file in a state directory of the user's own,
mode 0700: \$XDG_RUNTIME_DIR/elastic-rt (or /run/user/UID/elastic-rt), else
\${TMPDIR:-/tmp}/elastic-rt-UID; one that is a symbolic link, another user's, or
open to others is refused, and so is a pid file that is a link. A pid is
signalled only when it is this job's agent for that host (its command line
names the run id and the node id) and runs as this user.

Options:
  -f, --hostfile FILE   hosts, one per line: HOST [ADDR]; ADDR is the address the
                        other hosts reach this one at (default: HOST); # comments
  -H, --hosts LIST      comma-separated HOSTs instead of a hostfile
  --via ssh|pdsh|local  how to run on the hosts (default: pdsh if installed, else ssh).
                        pdsh: one pdsh -R exec over the ssh command (fan-out for
                        many hosts); ADDR must then equal HOST.
                        local: every "host" is a process on this machine, HOST a
                        loopback address such as 127.0.0.2 (for trying it and tests);
                        each agent also binds its metrics server to that address.
  --ssh CMD             ssh command (default: "ssh -o BatchMode=yes")
  --elastic-rt CMD      elastic-rt command on the hosts (default: elastic-rt)
  --workdir DIR         directory to start in on every host (default: this one)
  -e, --env NAME=VALUE  environment variable for the agents (repeatable); it shows
                        in \`ps\` here and on the hosts: never a secret
  --env-file FILE       NAME=VALUE lines for the agents' environment, '-' for
                        stdin: the way to pass secrets (tokens, keys). Sent to each
                        host over ssh's stdin into its state directory (0600), read
                        by the agent's shell and deleted; never on a command line
  -l, --log-dir DIR     per-host logs on this machine (default: logs/RDZV_ID)
  --run-dir DIR         the state directory on every host, instead of the default
                        (below); the same rules apply
  --rdzv-id ID          the job (drain/stop/status; run reads it from LAUNCH_OPTIONS)
  --timeout S           seconds drain waits for an agent to exit (default: 300)
  --fanout N            pdsh fan-out (default: 64)
  -h, --help            this text

Example:
  $PROG -f hosts.txt run --nnodes 2:4 --nproc-per-node 8 \\
      --rdzv-endpoint etcd1:2379,etcd2:2379,etcd3:2379 --rdzv-id job42 train.py --lr 0.1
  $PROG -f hosts.txt --rdzv-id job42 drain node3
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "$PROG: $*" >&2; }

HOSTFILE=""
HOSTS_CSV=""
VIA=""
SSH_CMD="ssh -o BatchMode=yes"
ELASTIC_RT=elastic-rt
WORKDIR=$PWD
ENVS=()
ENV_FILE=""
LOG_DIR=""
RUN_DIR=""
RDZV_ID=""
TIMEOUT=300
FANOUT=64

while [ $# -gt 0 ]; do
    case "$1" in
        -f|--hostfile) HOSTFILE=${2:?$1 needs a value}; shift 2 ;;
        -H|--hosts) HOSTS_CSV=${2:?$1 needs a value}; shift 2 ;;
        --via) VIA=${2:?$1 needs a value}; shift 2 ;;
        --ssh) SSH_CMD=${2:?$1 needs a value}; shift 2 ;;
        --elastic-rt) ELASTIC_RT=${2:?$1 needs a value}; shift 2 ;;
        --workdir) WORKDIR=${2:?$1 needs a value}; shift 2 ;;
        -e|--env) ENVS+=("${2:?$1 needs a value}"); shift 2 ;;
        --env-file) ENV_FILE=${2:?$1 needs a value}; shift 2 ;;
        -l|--log-dir) LOG_DIR=${2:?$1 needs a value}; shift 2 ;;
        --run-dir) RUN_DIR=${2:?$1 needs a value}; shift 2 ;;
        --rdzv-id) RDZV_ID=${2:?$1 needs a value}; shift 2 ;;
        --timeout) TIMEOUT=${2:?$1 needs a value}; shift 2 ;;
        --fanout) FANOUT=${2:?$1 needs a value}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { usage >&2; exit 2; }
COMMAND=$1; shift

if [ -z "$VIA" ]; then
    if command -v pdsh >/dev/null; then VIA=pdsh; else VIA=ssh; fi
fi
case "$VIA" in ssh|pdsh|local) ;; *) die "--via $VIA: use ssh, pdsh or local" ;; esac
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds"
[[ $FANOUT =~ ^[0-9]+$ ]] || die "--fanout must be a number"
read -r -a SSH <<<"$SSH_CMD"

# ---- hosts -----------------------------------------------------------------
HOSTS=()
ADDRS=()
add_host() {
    [[ $1 =~ ^[A-Za-z0-9._-]+$ ]] || die "host '$1': use letters, digits, '.', '_' or '-' (it is also the node id)"
    [[ $2 =~ ^[A-Za-z0-9._:%-]+$ ]] || die "address '$2' of host $1 is not a host name or IP address"
    HOSTS+=("$1")
    ADDRS+=("$2")
}
if [ -n "$HOSTFILE" ]; then
    [ -r "$HOSTFILE" ] || die "cannot read hostfile $HOSTFILE"
    while read -r host addr _rest; do
        case "$host" in ''|'#'*) continue ;; esac
        case "$addr" in '#'*) addr="" ;; esac
        add_host "$host" "${addr:-$host}"
    done <"$HOSTFILE"
fi
if [ -n "$HOSTS_CSV" ]; then
    IFS=, read -r -a _list <<<"$HOSTS_CSV"
    for host in "${_list[@]}"; do [ -n "$host" ] && add_host "$host" "$host"; done
fi
[ ${#HOSTS[@]} -gt 0 ] || die "no hosts: give --hostfile FILE or --hosts h1,h2"

addr_of() {
    local i
    for i in "${!HOSTS[@]}"; do
        if [ "${HOSTS[$i]}" = "$1" ]; then echo "${ADDRS[$i]}"; return 0; fi
    done
    return 1
}

# ---- quoting and running -----------------------------------------------------
# Quote one word for a POSIX shell on the other side of ssh: 'it'\''s'.
q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# Run a shell command line on a host: over ssh, or here for --via local.
on_host() {
    if [ "$VIA" = local ]; then
        sh -c "$2"
    else
        "${SSH[@]}" "$1" "$2"
    fi
}

# Shell code for a host: sets d to this job's state directory there, made if missing, after
# checking it and its parent (a directory of this user, mode 0700, no symbolic link); prints one
# line and exits 2 otherwise. $1: the host's name (or pdsh's %h).
state_dir() {
    local base
    if [ -n "$RUN_DIR" ]; then
        base=$(q "$RUN_DIR")
    else
        base="\"\$b\""
    fi
    printf '%s' "u=\$(id -u); r=\${XDG_RUNTIME_DIR:-/run/user/\$u}; \
if [ -d \"\$r\" ] && [ ! -L \"\$r\" ] && [ -O \"\$r\" ]; then b=\$r/elastic-rt; else b=\${TMPDIR:-/tmp}/elastic-rt-\$u; fi; \
d=$base/$(q "$RDZV_ID"); for x in $base \"\$d\"; do (umask 077 && mkdir -p \"\$x\") 2>/dev/null; \
if [ -L \"\$x\" ] || [ ! -d \"\$x\" ] || [ ! -O \"\$x\" ] || [ \"\$(ls -ldn \"\$x\" | cut -c1-10)\" != drwx------ ]; then \
echo $(q "$1"): refusing the state directory \"\$x\": it must be a directory of uid \$u with mode 0700, not a link >&2; exit 2; fi; done; "
}

# Shell code: sets pf to HOST's pid file in $d, refusing a symbolic link.
pid_file() {
    printf '%s' "pf=\"\$d\"/$(q "$1.pid"); if [ -L \"\$pf\" ]; then \
echo $(q "$1"): refusing \"\$pf\": it is a symbolic link >&2; exit 2; fi; "
}

# Shell code: the function is_agent PID, true when PID runs as this user and its command line is
# this job's agent on HOST (launch, --node-id=HOST, the run id), so that a stale pid file never
# gets another process signalled.
is_agent() {
    printf '%s' "is_agent() { [ -n \"\$1\" ] && [ -O /proc/\$1 ] && tr '\\000' '\\n' </proc/\$1/cmdline 2>/dev/null | \
awk -v n=$(q "--node-id=$1") -v id=$(q "$RDZV_ID") '\$0 == \"launch\" {l=1} \$0 == n {h=1} \
p && \$0 == id {r=1} \$0 == \"--rdzv-id=\" id || \$0 == \"--rdzv_id=\" id {r=1} \
{p = (\$0 == \"--rdzv-id\" || \$0 == \"--rdzv_id\")} END {exit !(l && h && r)}'; }; "
}

# The command line that runs on HOST (node id and pid file named after HOST).
agent_command() {
    local host=$1 addr=$2 cmd e a
    cmd="$(state_dir "$host")$(pid_file "$host")cd $(q "$WORKDIR") && echo \$\$ >\"\$pf.\$\$\" && mv -f \"\$pf.\$\$\" \"\$pf\""
    if [ -n "$ENV_FILE" ]; then
        # the secrets: read by this shell (export is a builtin: no command line shows them), then gone
        cmd+=" && ef=\"\$d\"/$(q "$host.env") && while IFS= read -r l; do export \"\$l\"; done <\"\$ef\" && rm -f \"\$ef\""
    fi
    cmd+=" && exec env"
    for e in "${ENVS[@]+"${ENVS[@]}"}"; do cmd+=" $(q "$e")"; done
    cmd+=" $ELASTIC_RT launch --node-id=$(q "$host") --local-addr=$(q "$addr")"
    if [ "$VIA" = local ] && [ "$HAS_METRICS_HOST" = 0 ]; then
        cmd+=" --metrics-host=$(q "$addr")"
    fi
    # %h in any argument becomes the host (pdsh does the same in its mode).
    for a in "${LAUNCH_ARGS[@]}"; do cmd+=" $(q "${a//%h/$host}")"; done
    echo "$cmd"
}

# Read --env-file (or stdin) once: NAME=VALUE lines, # comments and blank lines skipped.
ENV_DATA=""
read_env_file() {
    local line
    [ -n "$ENV_FILE" ] || return 0
    if [ "$ENV_FILE" != - ]; then [ -r "$ENV_FILE" ] || die "cannot read --env-file $ENV_FILE"; fi
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in ''|'#'*) continue ;; esac
        [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env-file: '${line%%=*}' is not NAME=VALUE"
        ENV_DATA+="$line"$'\n'
    done < <(if [ "$ENV_FILE" = - ]; then cat; else cat -- "$ENV_FILE"; fi)
}

# Put the environment file into each host's state directory (mode 0600), over ssh's stdin.
send_env_file() {
    local host n=0
    [ -n "$ENV_FILE" ] || return 0
    for host in "$@"; do
        printf '%s' "$ENV_DATA" | on_host "$host" "$(state_dir "$host")umask 077 && cat >\"\$d\"/$(q "$host.env")" &
        n=$((n + 1))
        if [ $((n % FANOUT)) = 0 ]; then wait; fi
    done
    wait
}

# SIGTERM the agent of each given host; wait up to WAIT_S s for it to exit (0: do
# not wait). Returns 1 if an agent is still running after that.
drain_hosts() {
    local wait_s=$1 host waiting rc=0; shift
    for host in "$@"; do
        waiting="echo '$host: SIGTERM sent to agent' \"\$p\""
        if [ "$wait_s" -gt 0 ]; then
            waiting+="; i=0; while kill -0 \"\$p\" 2>/dev/null; do \
if [ \$i -ge $((wait_s * 10)) ]; then echo '$host: agent still running after ${wait_s}s'; exit 1; fi; \
sleep 0.1; i=\$((i+1)); done; rm -f \"\$pf\"; echo '$host: agent exited'"
        fi
        on_host "$host" "$(state_dir "$host")$(pid_file "$host")$(is_agent "$host")p=\$(cat \"\$pf\" 2>/dev/null) || p=''; \
if [ -n \"\$p\" ] && ! is_agent \"\$p\"; then echo '$host: no agent running (the pid file names' \"\$p\" 'which is not its agent: not signalled)'; \
elif [ -n \"\$p\" ] && kill -TERM \"\$p\" 2>/dev/null; then $waiting; \
else echo '$host: no agent running'; fi" || rc=1
    done
    return "$rc"
}

# ---- commands ----------------------------------------------------------------
run_job() {
    [ $# -ge 1 ] || die "run: give the elastic-rt launch options, the script and its arguments"
    LAUNCH_ARGS=("$@")
    HAS_METRICS_HOST=0
    local i a next=""
    for a in "${LAUNCH_ARGS[@]}"; do
        if [ -n "$next" ]; then
            [ "$next" = id ] && RDZV_ID=$a
            next=""
            continue
        fi
        case "$a" in
            --rdzv-id=*|--rdzv_id=*) RDZV_ID=${a#*=} ;;
            --rdzv-id|--rdzv_id) next=id ;;
            --metrics-host|--metrics-host=*) HAS_METRICS_HOST=1 ;;
            --node-id|--node-id=*|--local-addr|--local-addr=*|--local_addr|--local_addr=*)
                die "run sets --node-id and --local-addr per host (from the hostfile); remove $a" ;;
        esac
    done
    [ -n "$RDZV_ID" ] || die "run: give --rdzv-id ID among the launch options (the same on every host)"
    [[ $RDZV_ID =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "--rdzv-id '$RDZV_ID': use letters, digits, '.', '_' or '-'"
    read_env_file
    LOG_DIR=${LOG_DIR:-logs/$RDZV_ID}
    mkdir -p "$LOG_DIR"

    STOPPING=0
    on_signal() {
        if [ "$STOPPING" = 0 ]; then
            STOPPING=1
            log "stopping the agents on ${#HOSTS[@]} host(s) (workers get their grace period)"
            drain_hosts 0 "${HOSTS[@]}" >/dev/null 2>&1 || true
        fi
    }
    trap on_signal INT TERM

    local rc=0
    if [ "$VIA" = pdsh ]; then
        command -v pdsh >/dev/null || die "--via pdsh: pdsh is not installed"
        for i in "${!HOSTS[@]}"; do
            [ "${HOSTS[$i]}" = "${ADDRS[$i]}" ] || die "--via pdsh: host ${HOSTS[$i]} has address ${ADDRS[$i]}; use --via ssh for per-host addresses"
        done
        local list cmd
        list=$(IFS=,; echo "${HOSTS[*]}")
        send_env_file "${HOSTS[@]}"
        # pdsh substitutes %h (the host) in every argument of the exec command.
        cmd=$(agent_command %h %h)
        for i in "${!HOSTS[@]}"; do : >"$LOG_DIR/${HOSTS[$i]}.log"; done
        log "starting on ${#HOSTS[@]} host(s) with pdsh; logs in $LOG_DIR/HOST.log"
        set +e
        pdsh -S -R exec -f "$FANOUT" -w "$list" "${SSH[@]}" %h "$cmd" 2>&1 |
            awk -v dir="$LOG_DIR" -v hosts="$list" '
                BEGIN { n = split(hosts, hs, ","); for (j = 1; j <= n; j++) known[hs[j]] = 1 }
                {
                    k = index($0, ": ")
                    if (k > 0 && (substr($0, 1, k - 1) in known)) {
                        f = dir "/" substr($0, 1, k - 1) ".log"
                        print substr($0, k + 2) >> f; fflush(f); next
                    }
                    print >> (dir "/pdsh.log"); fflush(dir "/pdsh.log"); print > "/dev/stderr"
                }'
        rc=${PIPESTATUS[0]}
        set -e
        log "pdsh finished with exit code $rc (the largest of the hosts')"
    else
        local pids=()
        send_env_file "${HOSTS[@]}"
        for i in "${!HOSTS[@]}"; do
            on_host "${HOSTS[$i]}" "$(agent_command "${HOSTS[$i]}" "${ADDRS[$i]}")" \
                </dev/null >"$LOG_DIR/${HOSTS[$i]}.log" 2>&1 &
            pids+=($!)
            log "${HOSTS[$i]}: started, log $LOG_DIR/${HOSTS[$i]}.log"
        done
        local code codes=() ok=0
        for i in "${!HOSTS[@]}"; do
            # wait returns early (>128) when a trapped signal arrives: wait again.
            while true; do
                set +e
                wait "${pids[$i]}"
                code=$?
                set -e
                if [ $code -gt 128 ] && kill -0 "${pids[$i]}" 2>/dev/null; then continue; fi
                break
            done
            codes+=("$code")
            if [ "$code" -eq 0 ]; then ok=1; fi
            if [ "$code" -eq 143 ]; then
                log "${HOSTS[$i]}: agent stopped by SIGTERM (drained)"
            else
                log "${HOSTS[$i]}: exit code $code"
            fi
        done
        # A drained host (143) is no failure when the job finished elsewhere.
        for code in "${codes[@]}"; do
            if [ "$code" -ne 0 ] && { [ "$code" -ne 143 ] || [ "$ok" = 0 ]; }; then rc=$code; break; fi
        done
    fi
    trap - INT TERM
    if [ "$rc" -eq 0 ]; then log "job $RDZV_ID finished on every host"; else log "job $RDZV_ID: some host failed (exit code $rc); see $LOG_DIR"; fi
    return "$rc"
}

need_id() {
    [ -n "$RDZV_ID" ] || die "$COMMAND: give --rdzv-id ID"
    [[ $RDZV_ID =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "--rdzv-id '$RDZV_ID': use letters, digits, '.', '_' or '-'"
}

case "$COMMAND" in
    run)
        [ "${1:-}" = -- ] && shift
        run_job "$@"
        ;;
    drain)
        need_id
        [ $# -ge 1 ] || die "drain: name the host(s) to drain"
        for h in "$@"; do addr_of "$h" >/dev/null || die "drain: $h is not in the host list"; done
        drain_hosts "$TIMEOUT" "$@"
        ;;
    stop)
        need_id
        drain_hosts "$TIMEOUT" "${HOSTS[@]}"
        ;;
    status)
        need_id
        for h in "${HOSTS[@]}"; do
            on_host "$h" "$(state_dir "$h")$(pid_file "$h")$(is_agent "$h")p=\$(cat \"\$pf\" 2>/dev/null) || p=''; \
if is_agent \"\$p\"; then echo '$h: running (pid' \"\$p)\"; else echo '$h: not running'; fi"
        done
        ;;
    *) die "unknown command '$COMMAND': run, drain, stop or status" ;;
esac
