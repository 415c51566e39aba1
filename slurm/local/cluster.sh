#!/usr/bin/env bash
# A real single-node Slurm cluster (slurmctld + slurmd + munged) on this machine, for tests and for trying
# `harness submit` locally. Runs as root, without systemd; everything lives under one state directory.
#
#   slurm/local/cluster.sh install              # apt-get the Debian packages (idempotent)
#   eval "$(slurm/local/cluster.sh start [DIR])" # start (or find running) and export SLURM_CONF
#   slurm/local/cluster.sh status [DIR]         # sinfo + squeue
#   slurm/local/cluster.sh stop [DIR]           # stop the daemons by their pid files
#
# DIR defaults to $HARNESS_SLURM_DIR or /tmp/harness-slurm. Ports: $HARNESS_SLURMCTLD_PORT (6817) and
# $HARNESS_SLURMD_PORT (6818), so that a test cluster can run beside a developer's one.
# HARNESS_SLURM_NODES=N (default 1) starts N nodes on this host, one slurmd each (node1 .. nodeN, sharing the
# CPUs and memory; slurmd ports HARNESS_SLURMD_PORT .. + N-1), for multi-node jobs.
# Only the `export ...` lines go to stdout (for eval); all progress and errors go to stderr.
# See slurm/local/README.md.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
BINARIES=(slurmctld slurmd sbatch squeue scontrol sinfo munged mungekey)

NODES=${HARNESS_SLURM_NODES:-1}
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || { echo "cluster.sh: error: HARNESS_SLURM_NODES=$NODES is not a count >= 1" >&2; exit 1; }

log() { echo "cluster.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

state_dir() {
    local dir="${1:-${HARNESS_SLURM_DIR:-/tmp/harness-slurm}}"
    mkdir -p "$dir"
    (cd "$dir" && pwd -P)
}

have_binaries() {
    local b
    for b in "${BINARIES[@]}"; do
        command -v "$b" >/dev/null 2>&1 || [[ -x "/usr/sbin/$b" ]] || return 1
    done
}

cmd_install() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        log "packages already installed: ${PACKAGES[*]}"
        return 0
    fi
    command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} by hand"
    local sudo=""
    [[ $(id -u) == 0 ]] || sudo="sudo"
    log "installing ${missing[*]}"
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2
}

# pid_alive PIDFILE: true when the file names a live process
pid_alive() {
    local pid
    [[ -s "$1" ]] || return 1
    pid=$(<"$1")
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

print_exports() {
    local dir=$1
    echo "export SLURM_CONF=$dir/slurm.conf"
    echo "export HARNESS_SLURM_DIR=$dir"
}

tails() {
    local dir=$1 f
    for f in "$dir"/log/munged.log "$dir"/log/slurmctld.log "$dir"/log/slurmd*.log; do
        [[ -f "$f" ]] || continue
        echo "----- tail $f" >&2
        tail -n 25 "$f" >&2
    done
}

node_state() {  # the first node's state as sinfo reports it ("idle", "down*", ...), or nothing
    { SLURM_CONF="$1/slurm.conf" sinfo -h -N -o '%T' 2>/dev/null || true; } | head -n1
}

nodes_up() {  # every one of the $NODES nodes is in one of the states given as a regex ($2)
    local states
    states=$({ SLURM_CONF="$1/slurm.conf" sinfo -h -N -o '%T' 2>/dev/null || true; } | grep -cE "^($2)" || true)
    [[ "$states" == "$NODES" ]]
}

node_names() {  # this cluster's node names: the host's own for one node, node1 .. nodeN for several
    if ((NODES == 1)); then hostname -s; else seq -f 'node%g' 1 "$NODES"; fi
}

slurmd_pidfile() {  # DIR NAME: the pid file of node NAME's slurmd (SlurmdPidFile, %n per node with several)
    if ((NODES == 1)); then echo "$1/run/slurmd.pid"; else echo "$1/run/slurmd-$2.pid"; fi
}

port_in_use() {  # something listens on TCP port $1 of this host
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# node_lines HOST SLURMD_PORT: the NodeName lines; several nodes split the host's CPUs and memory, and each
# slurmd listens on its own port (Debian's slurmd is built to run several times on one host)
node_lines() {
    local host=$1 port=$2 cpus mem i=0 name
    if ((NODES == 1)); then
        # `slurmd -C` prints "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1
        # RealMemory=24105"; we keep the hardware fields and give the node our name.
        slurmd -C | head -n1 | sed -E "s/^NodeName=[^ ]+/NodeName=$host/; s/$/ State=UNKNOWN/"
        return
    fi
    cpus=$(slurmd -C | head -n1 | sed -nE 's/.* CPUs=([0-9]+).*/\1/p')
    mem=$(slurmd -C | head -n1 | sed -nE 's/.* RealMemory=([0-9]+).*/\1/p')
    cpus=$((cpus / NODES > 0 ? cpus / NODES : 1))
    for name in $(node_names); do
        echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + i)) CPUs=$cpus" \
            "RealMemory=$((mem / NODES)) State=UNKNOWN"
        i=$((i + 1))
    done
}

write_conf() {
    local dir=$1 node=$2 ctld_port=$3 slurmd_port=$4 nodelines per=""
    nodelines=$(node_lines "$node" "$slurmd_port")
    [[ "$nodelines" == NodeName=* ]] || die "unexpected \`slurmd -C\` output: $nodelines"
    ((NODES == 1)) || per="-%n"
    cat >"$dir/slurm.conf" <<EOF
# Generated by slurm/local/cluster.sh; regenerated on every start of a stopped cluster.
ClusterName=harness
SlurmctldHost=$node
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool${per/-//}
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd$per.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd$per.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MinJobAge=600
MaxArraySize=100001
MaxJobCount=100000
JobRequeue=1
KillWait=5
InactiveLimit=0
$nodelines
PartitionName=debug Nodes=$(node_names | paste -sd,) Default=YES MaxTime=INFINITE State=UP
EOF
}

cmd_start() {
    local dir node ctld_port slurmd_port
    have_binaries || die "Slurm/munge binaries missing; run: $0 install"
    dir=$(state_dir "${1:-}")
    node=$(hostname -s)
    ctld_port=${HARNESS_SLURMCTLD_PORT:-6817}
    slurmd_port=${HARNESS_SLURMD_PORT:-6818}

    local name slurmds_alive=1
    for name in $(node_names); do pid_alive "$(slurmd_pidfile "$dir" "$name")" || slurmds_alive=0; done
    if pid_alive "$dir/run/slurmctld.pid" && ((slurmds_alive)) && pid_alive "$dir/run/munged.pid" \
        && nodes_up "$dir" 'idle|alloc|mix'; then
        log "cluster already running in $dir"
        print_exports "$dir"
        return 0
    fi
    # half-running (a crashed daemon): start from a clean slate of processes, keeping the job state
    cmd_stop "$dir" >/dev/null 2>&1 || true

    local port
    for port in "$ctld_port" $(seq "$slurmd_port" $((slurmd_port + NODES - 1))); do
        port_in_use "$port" && die "port $port is in use (another cluster? \`$0 stop DIR\` it, or pick free ports" \
            "with HARNESS_SLURMCTLD_PORT / HARNESS_SLURMD_PORT)"
    done

    mkdir -p "$dir"/{state,spool,run,log,munge}
    ((NODES == 1)) || for name in $(node_names); do mkdir -p "$dir/spool/$name"; done
    chmod 755 "$dir" "$dir/munge"   # munged refuses a socket dir that is not 755; clients must reach it

    # munge
    [[ -s "$dir/munge/munge.key" ]] || mungekey --create --keyfile="$dir/munge/munge.key" >&2
    chmod 600 "$dir/munge/munge.key"
    rm -f "$dir/munge/munge.socket" "$dir/munge/munge.socket.lock"
    munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" >&2 || { tails "$dir"; die "munged failed to start"; }

    write_conf "$dir" "$node" "$ctld_port" "$slurmd_port"
    slurmctld -f "$dir/slurm.conf" >&2 || { tails "$dir"; die "slurmctld failed to start"; }
    for name in $(node_names); do
        slurmd -f "$dir/slurm.conf" -N "$name" >&2 || { tails "$dir"; die "slurmd of $name failed to start"; }
    done

    local deadline=$((SECONDS + 30)) state=""
    while ((SECONDS < deadline)); do
        nodes_up "$dir" idle && break
        sleep 0.5
    done
    if ! nodes_up "$dir" idle; then
        state=$(node_state "$dir")
        tails "$dir"
        die "nodes $(node_names | paste -sd,) not all idle after 30 s (first: '${state:-none}'); logs under $dir/log"
    fi
    log "cluster up in $dir (nodes $(node_names | paste -sd,), $(SLURM_CONF="$dir/slurm.conf" sinfo -h -o '%c' | head -n1 | tr -d ' ')" \
        "CPUs each), slurmctld port $ctld_port)"
    print_exports "$dir"
}

# cancel_jobs DIR: scancel every live job, so that no slurmstepd or job process outlives the cluster
# (stopping slurmd alone leaves running jobs' slurmstepd behind); waits up to 10 s for them to end
cancel_jobs() {
    local dir=$1 ids i
    pid_alive "$dir/run/slurmctld.pid" || return 0
    export SLURM_CONF="$dir/slurm.conf"
    ids=$(squeue -h -t PENDING,RUNNING,SUSPENDED,REQUEUED,CONFIGURING,COMPLETING -o '%A' 2>/dev/null | sort -u) || return 0
    [[ -n "$ids" ]] || return 0
    log "cancelling jobs: $(echo $ids)"
    # shellcheck disable=SC2086
    scancel $ids 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        [[ -z "$(squeue -h -t RUNNING,COMPLETING,CONFIGURING -o '%A' 2>/dev/null)" ]] && return 0
        sleep 0.2
    done
    log "jobs still running after 10 s: $(squeue -h -t RUNNING,COMPLETING -o '%A' 2>/dev/null | tr '\n' ' ')"
}

# stop_pidfiles NAME... : TERM the daemons named (pid files under $dir/run), wait, KILL after 10 s
stop_pidfiles() {
    local name pid pids=() i
    for name in "$@"; do
        if pid_alive "$dir/run/$name.pid"; then
            pid=$(<"$dir/run/$name.pid")
            log "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    for ((i = 0; i < 100; i++)); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid did not exit within 10 s; killing"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    for name in "$@"; do rm -f "$dir/run/$name.pid"; done
}

cmd_stop() {
    local dir
    dir=$(state_dir "${1:-}")
    cancel_jobs "$dir"
    local slurmds=() f
    for f in "$dir"/run/slurmd*.pid; do [[ -e "$f" ]] && slurmds+=("$(basename "$f" .pid)"); done
    stop_pidfiles "${slurmds[@]}" slurmctld   # together: slurmctld saves its state on TERM, slurmd needs nothing
    stop_pidfiles munged             # last: the Slurm daemons talk through it until they exit
}

cmd_status() {
    local dir
    dir=$(state_dir "${1:-}")
    [[ -f "$dir/slurm.conf" ]] || die "no cluster in $dir (run: $0 start $dir)"
    export SLURM_CONF="$dir/slurm.conf"
    sinfo
    squeue -t all
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    status) cmd_status "${2:-}" ;;
    *)
        echo "usage: $0 {install|start [DIR]|stop [DIR]|status [DIR]}" >&2
        exit 2
        ;;
esac
