#!/usr/bin/env bash
# netcluster.sh -- emulate an N-node commodity-Ethernet cluster on one Linux box.
#
# Why: hhook's whole point is to cut gradient bytes on slow links. On a single
# machine every collective runs over loopback/shared memory at tens of GB/s,
# so compression can only ever look like overhead. This script gives each
# "node" its own network namespace with one shaped NIC so the profiler and
# training jobs (torch.distributed/gloo, Open MPI via mpi4py) see a realistic
# per-port bandwidth (default 1 Gbit/s full duplex, 1500 MTU).
#
# Topology (all of it lives in namespaces this script creates; nothing is
# added to the root namespace and no namespace has a default route, so no
# traffic can leave the box):
#
#   netns hhnet:  bridge hhbr0 -- hhv0 ... hhv{N-1}   (the "switch")
#   netns hhI:    eth0 = 10.77.0.(I+1)/24 (peer of hhvI), lo up, IPv6 off
#
#   tbf on hhI/eth0   shapes what rank I sends      (NIC TX)
#   tbf on hhnet/hhvI shapes what rank I receives   (NIC RX / switch port)
# so each rank has RATE in each direction, like a real switched port, and an
# N-to-1 incast is bottlenecked at the receiver's port as on real hardware.
# Outside the namespaces only /etc/netns/hhI/hosts is written ("ip netns
# exec" mounts it over /etc/hosts so the names hh0..hh{N-1} resolve); down
# removes it. The helpers (exec/launch/mpirun/rsh) also give each rank its own
# hostname hhI through a private UTS namespace.
#
# Requires root (CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 (ip, tc, bridge),
# util-linux (unshare, nsenter), python3; Open MPI + mpi4py for the MPI recipe.
#
# Nodes with several ranks (--ranks-per-node K): the K ranks of node I share
# its network namespace hhI (they talk to each other over its loopback path,
# unshaped, as GPUs of one machine do over NVLink/PCIe/shared memory) and one
# UTS namespace with hostname hhI (kept in /run/hhook-netcluster/uts-hhI, so
# hostname-based node detection sees nodes too); nodes are joined by the
# shaped links. Ranks are placed node by node, as torchrun places them:
# rank = I*K + j, LOCAL_RANK=j, LOCAL_WORLD_SIZE=K, GROUP_RANK=I. "up" records
# K (/run/hhook-netcluster/ranks_per_node) as the default of launch/mpirun/plan.
#
# Usage:
#   ci/netcluster.sh up N [RATE] [--ranks-per-node K]
#                                    # N nodes; RATE is a tc rate, default 1gbit;
#                                    # "none" = unshaped. An existing cluster is
#                                    # torn down first.
#   ci/netcluster.sh down            # idempotent, never fails
#   ci/netcluster.sh reshape RATE    # change every link's rate of the running
#                                    # cluster (jobs keep running: a link that
#                                    # slows down mid-run); "none" = unshaped
#   ci/netcluster.sh loss PERCENT    # every node drops that share of the packets it
#                                    # receives (nftables, random; works where the
#                                    # kernel has no netem); 0 = no loss
#   ci/netcluster.sh delay MS [JITTER_MS]
#                                    # every packet between nodes is held MS +-
#                                    # JITTER_MS (uniform, so packets overtake each
#                                    # other) by a user-space link (measure/delaylink.py,
#                                    # TUN devices; no netem needed); 0 = no delay
#   ci/netcluster.sh exec I CMD...   # run CMD inside namespace hhI
#   ci/netcluster.sh hosts [N]       # one address per line (MPI hostfile material)
#   ci/netcluster.sh measure [MB] [--duplex]   # TCP throughput hh0 -> hh1, prints MB/s
#   ci/netcluster.sh launch N [--ranks-per-node K] CMD...
#                                    # torchrun-like: K ranks of CMD in each of
#                                    # hh0..hh{N-1} with RANK, LOCAL_RANK etc.;
#                                    # non-zero if any rank fails (the rest are stopped)
#   ci/netcluster.sh plan N [--ranks-per-node K]
#                                    # the launcher variables launch would set, one
#                                    # line per rank (needs no root, no cluster)
#   ci/netcluster.sh mpirun N [--ranks-per-node K] CMD...
#                                    # Open MPI job, K ranks per namespace (slots=K,
#                                    # --map-by slot: node by node)
#   ci/netcluster.sh rsh HOST CMD... # (internal) Open MPI's plm_rsh_agent
#
# Recipe 1 -- torch.distributed / gloo, 4 ranks (init_process_group("gloo"),
# default env:// init):
#   ci/netcluster.sh up 4 1gbit
#   ci/netcluster.sh launch 4 python /tmp/gloo_ar.py
# which, apart from the per-rank hostname, is the same as
#   for I in 0 1 2 3; do
#     ip netns exec hh$I env RANK=$I WORLD_SIZE=4 LOCAL_RANK=0 \
#       MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 \
#       OMP_NUM_THREADS=1 python /tmp/gloo_ar.py &
#   done; wait
# (c10d's "The hostname of the client socket cannot be retrieved. err=-3",
# once per rank, is gone: "up" writes each address's IPv4-mapped form too.)
#
# Recipe 2 -- Open MPI + mpi4py, 4 ranks:
#   ci/netcluster.sh up 4 1gbit
#   ci/netcluster.sh mpirun 4 python /tmp/mpi_ar.py
# which is the same as (except that by hand mpirun and rank 0 keep the
# machine's hostname)
#   ci/netcluster.sh hosts 4 | sed 's/$/ slots=1/' >/tmp/hh.hosts
#   ip netns exec hh0 mpirun --allow-run-as-root --oversubscribe -np 4 \
#       --hostfile /tmp/hh.hosts --map-by node \
#       --mca plm_rsh_agent "$PWD/ci/netcluster.sh rsh" \
#       --mca btl tcp,self --mca btl_tcp_if_include eth0 \
#       --mca oob_tcp_if_include eth0 --mca mpi_yield_when_idle 1 \
#       python /tmp/mpi_ar.py
# mpirun has to run inside the emulated network (here in hh0): the orted
# daemons in the other namespaces connect back to it, and the root namespace
# is deliberately unreachable from them. There is no sshd between namespaces,
# so the rsh agent is this script: Open MPI calls it like ssh, as
# "rsh <host-address> <orted command words...>", and it maps the address back
# to its namespace and runs the words there through "sh -c", as sshd would.
# Extra mpirun options go in HH_MPIRUN_ARGS, e.g. the ring allreduce:
#   HH_MPIRUN_ARGS="--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4"
#
# Measured on a 2-core VM at 1gbit (25 MB = 6.25M fp32, median of 5):
#   measure: 119-120 MB/s each way, also with --duplex (theory: 125 MB/s
#            x 1448/1514 TCP payload per frame = 119.6 MB/s)
#   gloo all_reduce, 4 ranks: ~316 ms (ring theory 2*3/4*25 MB/119.6 MB/s = 314 ms)
#   Open MPI Allreduce, 4 ranks: ~520-620 ms with Open MPI 4.1's default
#            algorithm choice, ~345 ms with the ring (algorithm 4).
#
# Environment knobs: HH_PREFIX (default hh: the names of everything this script
# makes, namespaces ${HH_PREFIX}I and ${HH_PREFIX}net, bridge ${HH_PREFIX}br0, ports
# ${HH_PREFIX}vI, hostnames ${HH_PREFIX}I, /run/hhook-netcluster-${HH_PREFIX}: so
# several clusters live side by side; every command of one cluster needs the same
# HH_PREFIX), HH_SUBNET (default 10.77.0), HH_BURST (tbf burst bytes,
# default max(256 KiB, 2 ms at RATE)), HH_LATENCY (tbf queue bound, default
# 20ms), HH_DELAY_NICE (the delay forwarder's niceness, default -5), HH_MTU (default 1500), PYTHON (default python3), MASTER_PORT
# (default 29500), OMP_NUM_THREADS (default 1), HH_MPI_YIELD (default 1),
# HH_MPIRUN_ARGS.

set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
SUBNET=${HH_SUBNET:-10.77.0}
NP=${HH_PREFIX:-hh}            # the names of this cluster: namespaces ${NP}I, ${NP}net, ...
[[ $NP =~ ^[a-z][a-z0-9]{0,5}$ ]] || { echo "netcluster: HH_PREFIX must be 1-6 lower-case letters or digits, starting with a letter (got '$NP')" >&2; exit 1; }
BRNS=${NP}net
BR=${NP}br0
IFACE=eth0
LATENCY=${HH_LATENCY:-20ms}
MTU=${HH_MTU:-1500}
PYTHON=${PYTHON:-python3}
RUN_DIR=/run/hhook-netcluster   # ranks_per_node, rate, uts-hhI (the nodes' UTS namespaces), delay.pid
[[ $NP == hh ]] || RUN_DIR=/run/hhook-netcluster-$NP

die() { echo "netcluster: $*" >&2; exit 1; }
log() { echo "netcluster: $*" >&2; }

addr_of() { echo "$SUBNET.$(( $1 + 1 ))"; }

# Ranks that currently exist, in numeric order. Only names we create are
# considered, so an unrelated namespace is never touched.
existing_ranks() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NP}[0-9]+\$" \
        | sed "s/^${NP}//" | sort -n || true
}

cluster_size() { existing_ranks | wc -l; }

need_rank() {
    [[ $1 =~ ^[0-9]+$ ]] || die "rank must be a number, got '$1'"
    ip netns list | awk '{print $1}' | grep -qx "$NP$1" \
        || die "namespace $NP$1 does not exist (run: $0 up N)"
}

# tc itself understands the rate string; we only need bytes/s to size the
# tbf bucket. A bucket smaller than what the kernel may release per timer
# tick (or than one GSO super-packet) caps throughput below RATE, so use at
# least 256 KiB, and 2 ms worth of traffic at higher rates.
rate_bytes_per_s() {
    awk -v r="$1" 'BEGIN {
        if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit 1
        n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
        m["bit"]=1/8; m[""]=1/8; m["kbit"]=1e3/8; m["mbit"]=1e6/8; m["gbit"]=1e9/8; m["tbit"]=1e12/8
        m["kibit"]=1024/8; m["mibit"]=1048576/8; m["gibit"]=1073741824/8
        m["bps"]=1; m["kbps"]=1e3; m["mbps"]=1e6; m["gbps"]=1e9
        if (!(u in m)) exit 1
        printf "%d\n", n * m[u] }'
}

# Run CMD in rank I's namespace under its own hostname (a private UTS
# namespace). With one shared hostname Open MPI's per-host session dirs in
# /tmp collide between "nodes", MPI_Get_processor_name cannot tell nodes
# apart, and any host-based locality logic would think all ranks are local.
# The name resolves through /etc/netns/hhI/hosts, which "ip netns exec"
# bind-mounts over /etc/hosts.
# It is a command prefix rather than a function so that "${NS_ARGV[@]}" cmd &
# leaves $! = the rank process itself (every stage execs), which launch
# needs in order to stop the ranks.
ns_argv() {  # ns_argv I  -> sets NS_ARGV
    if [[ -e $RUN_DIR/uts-$NP$1 ]]; then
        # The node's own UTS namespace, made by "up": every rank of the node joins it.
        NS_ARGV=(ip netns exec "$NP$1" nsenter "--uts=$RUN_DIR/uts-$NP$1")
    else
        # shellcheck disable=SC2016  # $0/$@ belong to the inner sh
        NS_ARGV=(ip netns exec "$NP$1" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$NP$1")
    fi
}

# --ranks-per-node K, else what "up" recorded, else 1.
recorded_k() {
    local k=1
    [[ -r $RUN_DIR/ranks_per_node ]] && k=$(<"$RUN_DIR/ranks_per_node")
    [[ $k =~ ^[1-9][0-9]*$ ]] || k=1
    echo "$k"
}

check_k() {
    [[ $1 =~ ^[1-9][0-9]*$ ]] && (( $1 <= 64 )) || die "--ranks-per-node must be an integer in 1..64, got '$1'"
}

# The launcher variables of rank j on node i of n nodes x k, as torchrun sets
# them (RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE,
# GROUP_WORLD_SIZE, ROLE_WORLD_SIZE), plus NODE_RANK.
rank_env() {  # rank_env I J N K -> sets RANK_ENV
    local i=$1 j=$2 n=$3 k=$4 r=$(( $1 * $4 + $2 ))
    RANK_ENV=(RANK="$r" WORLD_SIZE="$(( n * k ))" LOCAL_RANK="$j" LOCAL_WORLD_SIZE="$k"
              GROUP_RANK="$i" GROUP_WORLD_SIZE="$n" ROLE_RANK="$r" ROLE_WORLD_SIZE="$(( n * k ))"
              NODE_RANK="$i")
}

burst_for() {  # burst_for RATE -> tbf burst bytes (HH_BURST, else 2 ms of RATE, at least 256 KiB)
    local bps
    bps=$(rate_bytes_per_s "$1") || die "cannot parse RATE '$1' (use e.g. 100mbit, 1gbit, 10gbit)"
    echo "${HH_BURST:-$(( bps / 500 > 262144 ? bps / 500 : 262144 ))}"
}

shape() {  # shape NS DEV RATE BURST
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf \
        rate "$3" burst "$4" latency "$LATENCY"
}

cmd_reshape() {  # reshape RATE: the running cluster's links, in place
    local rate=${1:-} bps burst i
    [[ -n $rate ]] || die "usage: reshape RATE"
    [[ $(id -u) == 0 ]] || die "must run as root (needs CAP_NET_ADMIN)"
    [[ -n $(existing_ranks) ]] || die "reshape: no cluster is up"
    [[ $rate == none ]] || burst=$(burst_for "$rate")
    for i in $(existing_ranks); do
        if [[ $rate == none ]]; then
            ip netns exec "$NP$i" tc qdisc del dev "$IFACE" root 2>/dev/null || true
            ip netns exec "$BRNS" tc qdisc del dev "${NP}v$i" root 2>/dev/null || true
        else
            shape "$NP$i" "$IFACE" "$rate" "$burst"
            shape "$BRNS" "${NP}v$i" "$rate" "$burst"
        fi
        # the delayed link's device (netcluster.sh delay), where there is one
        if ip -n "$NP$i" link show "${NP}d$i" >/dev/null 2>&1; then
            if [[ $rate == none ]]; then
                ip netns exec "$NP$i" tc qdisc del dev "${NP}d$i" root 2>/dev/null || true
            else
                shape "$NP$i" "${NP}d$i" "$rate" "$burst"
            fi
        fi
    done
    echo "$rate" >"$RUN_DIR/rate"
    log "reshape: every link now ${rate}${burst:+ burst ${burst}b}"
}

stop_delay() {  # end measure/delaylink.py: its TUN devices, and the routes through them, go with it
    local pid i
    [[ -s $RUN_DIR/delay.pid ]] || return 0
    pid=$(<"$RUN_DIR/delay.pid")
    if [[ $pid =~ ^[0-9]+$ ]] && kill -TERM "$pid" 2>/dev/null; then
        for (( i = 0; i < 50; i++ )); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f -- "$RUN_DIR/delay.pid"
}

cmd_delay() {  # delay MS [JITTER_MS]: hold every packet between nodes MS +- JITTER_MS
    local ms=${1:-} jitter=${2:-0} rate=none burst="" pid i
    ms=${ms%ms}; jitter=${jitter%ms}
    [[ $ms =~ ^[0-9]+(\.[0-9]+)?$ && $jitter =~ ^[0-9]+(\.[0-9]+)?$ ]] \
        || die "usage: delay MS [JITTER_MS] (e.g. 5 2; 0 removes the delay)"
    [[ $(id -u) == 0 ]] || die "must run as root (needs CAP_NET_ADMIN)"
    [[ -n $(existing_ranks) ]] || die "delay: no cluster is up"
    stop_delay
    if awk -v m="$ms" 'BEGIN { exit !(m == 0) }'; then
        log "delay: none (traffic back on eth0)"
        return 0
    fi
    [[ -r $RUN_DIR/rate ]] && rate=$(<"$RUN_DIR/rate")
    [[ $rate == none ]] || burst=$(burst_for "$rate")
    mkdir -p "$RUN_DIR"
    # The forwarder is the link: it must not wait behind the jobs it carries (a caller under
    # nice would otherwise starve it on a busy host), hence its own priority.
    setsid nice -n "${HH_DELAY_NICE:--5}" "$PYTHON" "$(dirname "$SELF")/../measure/delaylink.py" --nodes "$(cluster_size)" --prefix "$NP" --subnet "$SUBNET" \
        --delay-ms "$ms" --jitter-ms "$jitter" --rate "$rate" ${burst:+--burst "$burst"} --latency "$LATENCY" \
        --pidfile "$RUN_DIR/delay.pid" </dev/null >"$RUN_DIR/delay.log" 2>&1 &
    pid=$!
    for (( i = 0; i < 100; i++ )); do
        [[ -s $RUN_DIR/delay.pid ]] && break
        kill -0 "$pid" 2>/dev/null || { cat "$RUN_DIR/delay.log" >&2; die "delay: the user-space link failed to start"; }
        sleep 0.1
    done
    [[ -s $RUN_DIR/delay.pid ]] || { kill -TERM "$pid" 2>/dev/null; die "delay: the user-space link did not come up in 10 s"; }
    log "delay: every packet between nodes held ${ms} ms +- ${jitter} ms (user-space link, pid $pid, rate $rate)"
}

cmd_loss() {  # loss PERCENT: each node drops that share of what it receives on its link
    local pct=${1:-} per_million i
    pct=${pct%\%}
    [[ $pct =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "usage: loss PERCENT (e.g. 1 or 5%; 0 removes the loss)"
    [[ $(id -u) == 0 ]] || die "must run as root (needs CAP_NET_ADMIN)"
    [[ -n $(existing_ranks) ]] || die "loss: no cluster is up"
    command -v nft >/dev/null || die "loss needs nftables (apt-get install nftables)"
    per_million=$(awk -v p="$pct" 'BEGIN { printf "%d", p * 10000 }')
    (( per_million <= 1000000 )) || die "loss: at most 100%"
    for i in $(existing_ranks); do
        ip netns exec "$NP$i" nft delete table inet hhloss 2>/dev/null || true
        (( per_million > 0 )) || continue
        # On input: the sender sees a real loss (no ACK), and TCP retransmits.
        ip netns exec "$NP$i" nft add table inet hhloss
        ip netns exec "$NP$i" nft add chain inet hhloss input '{ type filter hook input priority 0; policy accept; }'
        ip netns exec "$NP$i" nft add rule inet hhloss input iifname "$IFACE" numgen random mod 1000000 lt "$per_million" counter drop
    done
    log "loss: every node now drops ${pct}% of the packets it receives"
}

cmd_down() {
    set +e
    local ns
    local -a pids
    stop_delay
    for ns in $(existing_ranks | sed "s/^/$NP/") $BRNS; do
        ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$ns" || continue
        # A namespace outlives "ip netns del" while processes still run in it
        # (leftover ranks/orteds of a crashed job). Those can only be ours.
        mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
        if (( ${#pids[@]} )); then
            log "stopping leftover processes in $ns: ${pids[*]}"
            kill -TERM "${pids[@]}" 2>/dev/null
            sleep 1
            mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
            (( ${#pids[@]} )) && kill -KILL "${pids[@]}" 2>/dev/null
        fi
        # Deleting the namespace destroys its veth end, and with it the peer
        # (and, for hhnet, the bridge).
        ip netns del "$ns" 2>/dev/null
    done
    local d u
    for u in "$RUN_DIR"/uts-"$NP"[0-9]*; do
        [[ -e $u ]] || continue
        umount "$u" 2>/dev/null
        rm -f -- "$u"
    done
    rm -f -- "$RUN_DIR/ranks_per_node" "$RUN_DIR/rate" "$RUN_DIR/delay.log"
    [[ -d $RUN_DIR ]] && rmdir "$RUN_DIR" 2>/dev/null
    for d in /etc/netns/"$NP"[0-9]*; do
        [[ -d $d && ${d##*/} =~ ^$NP[0-9]+$ ]] && rm -rf -- "$d"
    done
    [[ -d /etc/netns ]] && rmdir /etc/netns 2>/dev/null
    set -e
    return 0
}

cmd_up() {
    local n="" rate=1gbit k=1 i bps burst
    local -a pos=()
    while (( $# )); do
        case $1 in
            --ranks-per-node) k=${2:-}; shift 2 || die "usage: up N [RATE] [--ranks-per-node K]" ;;
            --ranks-per-node=*) k=${1#*=}; shift ;;
            *) pos+=("$1"); shift ;;
        esac
    done
    n=${pos[0]:-}; rate=${pos[1]:-1gbit}
    if ! [[ $n =~ ^[0-9]+$ ]] || (( n < 1 || n > 250 || ${#pos[@]} > 2 )); then
        die "usage: up N [RATE] [--ranks-per-node K] (1 <= N <= 250)"
    fi
    check_k "$k"
    [[ $(id -u) == 0 ]] || die "must run as root (needs CAP_NET_ADMIN/CAP_SYS_ADMIN)"
    if [[ -n $(existing_ranks) ]] || ip netns list | awk '{print $1}' | grep -qx "$BRNS"; then
        log "existing cluster found; tearing it down first"
        cmd_down
    fi
    [[ $rate == none ]] || burst=$(burst_for "$rate")
    # On any failure half-way (set -e may exit from inside a helper, where an
    # ERR trap would not fire), leave nothing behind.
    UP_DONE=0
    trap '(( UP_DONE )) || { log "up failed; cleaning up"; cmd_down; }' EXIT

    ip netns add "$BRNS"
    ip -n "$BRNS" link set lo up
    ip -n "$BRNS" link add "$BR" type bridge
    # The emulated switch must forward as soon as a port is up: no STP
    # listening/learning delay.
    ip -n "$BRNS" link set "$BR" type bridge stp_state 0 forward_delay 0
    ip -n "$BRNS" link set "$BR" up

    for (( i = 0; i < n; i++ )); do
        local ns=$NP$i port=${NP}v$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # IPv6 would add link-local addresses that Open MPI/gloo may pick and
        # DAD/RS chatter on the shaped link; the cluster is IPv4-only.
        ip netns exec "$ns" sh -c 'echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6' 2>/dev/null || true
        # Create the pair directly in its final namespaces so nothing ever
        # appears in the root namespace.
        ip -n "$BRNS" link add "$port" mtu "$MTU" type veth peer name "$IFACE" netns "$ns"
        ip -n "$ns" link set "$IFACE" mtu "$MTU"
        ip -n "$BRNS" link set "$port" master "$BR"
        ip -n "$ns" addr add "$(addr_of "$i")/24" dev "$IFACE"
        ip -n "$BRNS" link set "$port" up
        ip -n "$ns" link set "$IFACE" up
        if [[ $rate != none ]]; then
            shape "$ns" "$IFACE" "$rate" "$burst"     # rank -> switch
            shape "$BRNS" "$port" "$rate" "$burst"    # switch -> rank
        fi
    done
    # Keep the machine's own entries: "ip netns exec" without our hostname
    # switch still reports the root hostname, which must keep resolving.
    # Each address also in its IPv4-mapped IPv6 form (::ffff:a.b.c.d): c10d's
    # store client connects through an IPv6 socket to that form of
    # MASTER_ADDR and names it with getnameinfo, which finds no IPv4 line for
    # it and asks DNS, which no namespace reaches: torch then logged "The
    # hostname of the client socket cannot be retrieved. err=-3" once per
    # rank (and per process group).
    local hosts
    hosts=$(cat /etc/hosts 2>/dev/null || printf '127.0.0.1\tlocalhost\n'
            echo "# netcluster.sh ranks"
            for (( i = 0; i < n; i++ )); do printf '%s\t%s%d\n' "$(addr_of "$i")" "$NP" "$i"; done
            for (( i = 0; i < n; i++ )); do printf '::ffff:%s\t%s%d\n' "$(addr_of "$i")" "$NP" "$i"; done)
    for (( i = 0; i < n; i++ )); do
        mkdir -p "/etc/netns/$NP$i"
        echo "$hosts" >"/etc/netns/$NP$i/hosts"
    done
    # One UTS namespace per node, kept by a bind mount, so all K ranks of a
    # node share it (and its hostname hhI).
    mkdir -p "$RUN_DIR"
    echo "$k" >"$RUN_DIR/ranks_per_node"
    echo "$rate" >"$RUN_DIR/rate"
    for (( i = 0; i < n; i++ )); do
        : >"$RUN_DIR/uts-$NP$i"
        unshare "--uts=$RUN_DIR/uts-$NP$i" hostname "$NP$i"
    done
    # shellcheck disable=SC2034  # read by the EXIT trap
    UP_DONE=1

    # With STP off the ports forward as soon as they are up, but confirm it so
    # callers can start jobs immediately (no ping dependency).
    for (( i = 0; i < 50; i++ )); do
        (( $(bridge -n "$BRNS" link show | grep -c 'state forwarding') == n )) && break
        sleep 0.1
    done
    log "up: $n nodes x $k ranks, $SUBNET.1-$SUBNET.$n on $IFACE, rate ${rate}${burst:+ burst ${burst}b} latency $LATENCY"
}

cmd_exec() {
    local i=${1:-}; shift || true
    need_rank "$i"
    (( $# > 0 )) || die "usage: exec I CMD..."
    ns_argv "$i"
    exec "${NS_ARGV[@]}" "$@"
}

cmd_hosts() {
    local n=${1:-$(cluster_size)} i
    (( n > 0 )) || die "no cluster up and no N given"
    for (( i = 0; i < n; i++ )); do addr_of "$i"; done
}

# Sender/receiver in plain Python so no extra package (iperf3) is needed.
# Times from the first received byte to EOF on the receiver, which excludes
# connection setup and the sender's last unacked window.
MEASURE_PY='
import socket, sys, time
mode, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); buf = bytearray(1 << 20); got = 0; t0 = None
    while True:
        k = c.recv_into(buf)
        if not k: break
        if t0 is None: t0 = time.perf_counter()
        got += k
    dt = time.perf_counter() - t0
    print(f"{got/1e6/dt:.1f}")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((host, port)); break
        except OSError: time.sleep(0.05)
    chunk = bytes(1 << 20); left = nbytes
    while left > 0:
        c.sendall(chunk[:min(left, len(chunk))]); left -= len(chunk)
    c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
'

measure_pair() {  # measure_pair SRC DST MB PORT -> prints MB/s
    local src=$1 dst=$2 mb=$3 port=$4 fifo out
    fifo=$(mktemp -u); mkfifo "$fifo"; out=$(mktemp)
    ip netns exec "$NP$dst" "$PYTHON" -c "$MEASURE_PY" recv "$(addr_of "$dst")" "$port" 0 >"$fifo" &
    local rpid=$!
    # Block until the receiver is listening; the rest of its output is the result.
    { read -r _; cat >"$out"; } <"$fifo" &
    local cpid=$!
    ip netns exec "$NP$src" "$PYTHON" -c "$MEASURE_PY" send "$(addr_of "$dst")" "$port" $(( mb * 1000000 ))
    wait "$rpid"; wait "$cpid"
    cat "$out"; rm -f "$fifo" "$out"
}

cmd_measure() {
    local mb=100 duplex=0 a
    for a in "$@"; do
        case $a in
            --duplex) duplex=1 ;;
            *) [[ $a =~ ^[0-9]+$ ]] || die "usage: measure [MB] [--duplex]"; mb=$a ;;
        esac
    done
    need_rank 0; need_rank 1
    if (( duplex )); then
        # Both directions at once: a full-duplex port should keep ~RATE each way.
        local f1 f2; f1=$(mktemp); f2=$(mktemp)
        measure_pair 0 1 "$mb" 5201 >"$f1" & local p1=$!
        measure_pair 1 0 "$mb" 5202 >"$f2" & local p2=$!
        wait "$p1"; wait "$p2"
        echo "${NP}0->${NP}1 $(cat "$f1") MB/s"
        echo "${NP}1->${NP}0 $(cat "$f2") MB/s"
        rm -f "$f1" "$f2"
    else
        echo "${NP}0->${NP}1 $(measure_pair 0 1 "$mb" 5201) MB/s"
    fi
}

launch_reaped() {  # launch_reaped PID RC  (uses cmd_launch's rank_of/fail)
    local i=${rank_of[$1]}
    unset "rank_of[$1]"
    if (( $2 != 0 && ! fail )); then
        log "rank $i exited with status $2; stopping the other ranks"
        fail=$2
        if (( ${#rank_of[@]} > 0 )); then kill -TERM "${!rank_of[@]}" 2>/dev/null || true; fi
    fi
    return 0
}

# "N [--ranks-per-node K] CMD..." -> NODES, PER_NODE, CMD_ARGV
parse_job() {  # parse_job WHAT ARGS...
    local what=$1; shift
    NODES=${1:-}; shift || true
    PER_NODE=$(recorded_k)
    case ${1:-} in
        --ranks-per-node) PER_NODE=${2:-}; shift 2 || die "usage: $what N [--ranks-per-node K] CMD..." ;;
        --ranks-per-node=*) PER_NODE=${1#*=}; shift ;;
    esac
    CMD_ARGV=("$@")
    [[ $NODES =~ ^[0-9]+$ ]] && (( NODES >= 1 )) || die "usage: $what N [--ranks-per-node K] CMD..."
    check_k "$PER_NODE"
}

cmd_plan() {
    parse_job plan "$@"
    local i j
    for (( i = 0; i < NODES; i++ )); do
        for (( j = 0; j < PER_NODE; j++ )); do
            rank_env "$i" "$j" "$NODES" "$PER_NODE"
            echo "$NP$i ${RANK_ENV[*]}"
        done
    done
}

cmd_launch() {
    local i j rc=0 pid fail=0 n
    parse_job launch "$@"
    n=$NODES
    (( ${#CMD_ARGV[@]} > 0 )) || die "usage: launch N [--ranks-per-node K] CMD..."
    set -- "${CMD_ARGV[@]}"
    for (( i = 0; i < n; i++ )); do need_rank "$i"; done
    local -A rank_of=()
    # Async children of a non-interactive shell ignore SIGINT, so Ctrl-C (or
    # a CI timeout's TERM) must be forwarded or the ranks would live on.
    trap '(( ${#rank_of[@]} )) && kill -TERM "${!rank_of[@]}" 2>/dev/null; exit 130' INT TERM
    for (( i = 0; i < n; i++ )); do
        for (( j = 0; j < PER_NODE; j++ )); do
            # OMP_NUM_THREADS=1 mirrors torchrun: N ranks sharing a small box
            # must not each spin up one OpenMP thread per core.
            ns_argv "$i"
            rank_env "$i" "$j" "$n" "$PER_NODE"
            "${NS_ARGV[@]}" env "${RANK_ENV[@]}" \
                MASTER_ADDR="$(addr_of 0)" MASTER_PORT="${MASTER_PORT:-29500}" \
                GLOO_SOCKET_IFNAME="$IFACE" TP_SOCKET_IFNAME="$IFACE" \
                OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
                "$@" &
            rank_of[$!]=$(( i * PER_NODE + j ))
        done
    done
    # Like torchrun: once one rank fails the others would block in a
    # collective until gloo's 30 min timeout, so stop them.
    while (( ${#rank_of[@]} > 0 )); do
        pid=; rc=0
        wait -n -p pid || rc=$?
        if [[ -z ${pid:-} ]]; then
            # bash can drop jobs that ended at the same moment from what
            # "wait -n" reports; their statuses are still kept per pid.
            for pid in "${!rank_of[@]}"; do
                rc=0; wait "$pid" || rc=$?
                launch_reaped "$pid" "$rc"
            done
            break
        fi
        [[ -v "rank_of[$pid]" ]] && launch_reaped "$pid" "$rc"
    done
    return "$fail"
}

cmd_mpirun() {
    local n i
    parse_job mpirun "$@"
    n=$NODES
    (( ${#CMD_ARGV[@]} > 0 )) || die "usage: mpirun N [--ranks-per-node K] CMD..."
    set -- "${CMD_ARGV[@]}"
    for (( i = 0; i < n; i++ )); do need_rank "$i"; done
    HOSTFILE=$(mktemp /tmp/hh-hostfile.XXXXXX)   # global: the EXIT trap outlives this function
    trap 'rm -f "$HOSTFILE"' EXIT
    # K slots per node, filled node by node (--map-by slot): ranks I*K..I*K+K-1
    # on node I, as torchrun places them; Open MPI sets OMPI_COMM_WORLD_LOCAL_RANK
    # and OMPI_COMM_WORLD_LOCAL_SIZE itself.
    for (( i = 0; i < n; i++ )); do echo "$(addr_of "$i") slots=$PER_NODE"; done >"$HOSTFILE"
    local map=node
    (( PER_NODE > 1 )) && map=slot
    # Each "node" has one slot, so Open MPI believes nothing is oversubscribed
    # and busy-polls; here all ranks share a few cores, so spinning ranks
    # would steal CPU from the ones doing reductions -- an artifact a real
    # cluster does not have. Hence yield_when_idle (HH_MPI_YIELD=0 to disable).
    # The agent string is split on spaces by Open MPI, hence no spaces in $SELF.
    # It runs as mpirun's child, so the orteds (and ranks) inherit this
    # environment (PATH, venv/pyenv, PYTHONPATH) unlike with real ssh.
    local rc=0
    ns_argv 0
    # shellcheck disable=SC2086  # HH_MPIRUN_ARGS is intentionally word-split
    "${NS_ARGV[@]}" mpirun --allow-run-as-root --oversubscribe -np "$(( n * PER_NODE ))" \
        --hostfile "$HOSTFILE" --map-by "$map" \
        --mca plm_rsh_agent "$SELF rsh" \
        --mca btl tcp,self --mca btl_tcp_if_include "$IFACE" \
        --mca oob_tcp_if_include "$IFACE" \
        --mca mpi_yield_when_idle "${HH_MPI_YIELD:-1}" \
        -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        ${HH_MPIRUN_ARGS:-} "$@" || rc=$?
    return "$rc"
}

# Open MPI's launcher contract is that of ssh: "agent HOST WORD...", where the
# words are joined with spaces and interpreted by the remote user's shell.
cmd_rsh() {
    local host=${1:-} i=""
    shift || true
    # Open MPI may insert ssh-style options before the host.
    while [[ $host == -* ]]; do host=${1:-}; shift || true; done
    case $host in
        "$NP"[0-9]*) i=${host#"$NP"} ;;
        "$SUBNET".*) i=$(( ${host##*.} - 1 )) ;;
        *) die "rsh: unknown host '$host' (expected $SUBNET.X or hhI)" ;;
    esac
    need_rank "$i"
    ns_argv "$i"
    exec "${NS_ARGV[@]}" /bin/sh -c "$*"
}

main() {
    local sub=${1:-}
    shift || true
    case $sub in
        up) cmd_up "$@" ;;
        down) cmd_down ;;
        reshape) cmd_reshape "$@" ;;
        loss) cmd_loss "$@" ;;
        delay) cmd_delay "$@" ;;
        exec) cmd_exec "$@" ;;
        hosts) cmd_hosts "$@" ;;
        measure) cmd_measure "$@" ;;
        launch) cmd_launch "$@" ;;
        plan) cmd_plan "$@" ;;
        mpirun) cmd_mpirun "$@" ;;
        rsh) cmd_rsh "$@" ;;
        *) sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
}

main "$@"
