#!/usr/bin/env bash
# san-verbs-memory-guest.sh - runs inside the soft-RDMA guest (see test-san-verbs.sh), after
# san-verbs-guest.sh: the preload's registration cache over verbs as applications meet it.
# One line per case, then "san-verbs-memory: N passed, M failed".
#
#   usage: san-verbs-memory-guest.sh TARGET_PROFILE_DIR [ROUNDS]
#
# memory-changes-{read,write}: a preloaded pair across the guest's two addresses; the client
#   sends 1 MiB buffers (the verbs rendezvous threshold) in single sends, ROUNDS (4) per variant
#   (2 in READ mode), each round from new memory at the previous round's address holding the
#   stream's next bytes: free() + malloc() (glibc unmaps and maps again), munmap + mmap, mremap
#   away + mmap, MADV_DONTNEED, MADV_FREE, and the heap trimmed by free() (brk, or glibc's
#   malloc_trim) and grown again by malloc(). The server receives into a fresh malloc per
#   round and checks every byte (a stale registration shows as an earlier round's bytes).
#   Asserted: the address repeated and the mapping changed every round, every round went by
#   rendezvous (the published counters), all bytes intact. READ mode is the default; WRITE
#   mode (SANDIRECT_SAN_RDMA_READ=0) is where a missed invalidation would send stale pages.
# enobufs-memlock: the client, without CAP_IPC_LOCK and with RLIMIT_MEMLOCK at 2 MiB (its
#   connection pins 1 MiB of slots), sends 1.5 MiB in single sends: each must fail with ENOBUFS
#   and send nothing; the application resends the bytes in 256 KiB sends. The server must
#   receive exactly the accepted bytes, in order.
# connections-memlock: the client, limited as above, opens 4 connections one after another
#   (each set up while the earlier ones stay open, each pinning 1 MiB of slots) and then
#   echoes 1 MiB on all of them at once: the connections the limit leaves no memory for stay
#   on TCP (the client declines the acceptor's connect: reason `san-resources`), the first
#   ones use the SAN, and every echo is intact.
# acceptor-connections-memlock: the same with the limit on the server: the acceptor cannot
#   set its side up before connecting, the connection stays on TCP (`san-resources` there).
# receiver-memlock: the limit on the server instead (receive buffer 8 MiB): the client's 1.5 MiB
#   sends are not refused (so the refusals above come from the limit), the receiver turns the
#   rendezvous down and the bytes come inline, none lost.
set -uo pipefail
T=$1; ROUNDS=${2:-4}
S=${SANDIRECT_TEST_SERVER_IP:-192.0.2.1}; C=${SANDIRECT_TEST_CLIENT_IP:-192.0.2.2}
M=$T/san_memory
X=$T/san_xhost
LOGS=$(mktemp -d)
pre=(env LD_PRELOAD="$T/libsandirect.so" SANDIRECT_SAN=1 SANDIRECT_SAN_PROVIDER=verbs
     SANDIRECT_VERBS_LIBRARY="$T/libsandirect_verbs.so" SANDIRECT_LOG="${SANDIRECT_LOG:-debug}")
# The limited side of the memlock cases: root keeps CAP_IPC_LOCK, which exempts it from the
# limit.
limited=(setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock prlimit --memlock=$((2 << 20)))
VARIANTS=(free munmap mremap dontneed madv-free brk)
pass=0; fail=0
# SANDIRECT_SAN_VERBS_CASES="name …" runs only the cases named (default: all of them).
selected() { [[ -z ${SANDIRECT_SAN_VERBS_CASES:-} || " $SANDIRECT_SAN_VERBS_CASES " == *" $1 "* ]]; }

# run_pair NAME: runs server_cmd preloaded until it announces its port, then client_cmd
# (each @PORT@ in it replaced by that port); sets sout/cout (their last lines), crc/src (exit
# statuses), took. Both get the variables in mode_env (VAR=VALUE words) after the preload's;
# server_prefix/client_prefix run them (setpriv, prlimit).
mode_env=(); server_prefix=(); client_prefix=(); server_cmd=(); client_cmd=()
run_pair() {
  local name=$1 start port srv
  start=$(date +%s.%N)
  timeout 150 "${server_prefix[@]}" "${pre[@]}" "${mode_env[@]}" "${server_cmd[@]}" >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  srv=$!
  for _ in $(seq 600); do grep -q '^port ' "$LOGS/$name.server.out" 2>/dev/null && break; sleep 0.1; done
  port=$(sed -n 's/^port //p' "$LOGS/$name.server.out")
  if [[ -z $port ]]; then
    crc=1; src=1; cout="(server did not start)"; sout=""; kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
  else
    timeout 150 "${client_prefix[@]}" "${pre[@]}" "${mode_env[@]}" "${client_cmd[@]//@PORT@/$port}" >"$LOGS/$name.client.out" 2>"$LOGS/$name.client.err"
    crc=$?
    wait "$srv"; src=$?
    cout=$(tail -n 1 "$LOGS/$name.client.out"); sout=$(tail -n 1 "$LOGS/$name.server.out")
  fi
  took=$(echo "$(date +%s.%N) - $start" | bc)
}

# pair NAME BUFFER CLIENT_MODE CLIENT_ARGS…: a san_memory server (receive buffer BUFFER) and
# client, as run_pair runs them.
pair() {
  local name=$1 buffer=$2 mode=$3; shift 3
  server_cmd=("$M" server "$S" "$buffer")
  client_cmd=("$M" "$mode" "$S:@PORT@" "$C" "$@")
  run_pair "$name"
}

field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }

report() {
  local name=$1 ok=$2 detail=$3
  if [[ $ok == 1 ]]; then
    echo "san-verbs-memory: $name ok ($detail; ${took} s)"
    pass=$((pass+1))
  else
    echo "san-verbs-memory: $name FAIL (client rc=$crc: $cout | server rc=$src: $sout)"
    cat "$LOGS/$name.client.out"
    echo "--- client stderr"; tail -n 40 "$LOGS/$name.client.err"
    echo "--- server stderr"; tail -n 40 "$LOGS/$name.server.err"
    fail=$((fail+1))
  fi
}

# The common part of every case: both exited 0, the server checked as many bytes as the
# client counted, both on SAN-verbs.
delivered() {
  [[ $crc == 0 && $src == 0 && $cout == "client ok "* && $sout == "server ok "* ]] || return 1
  [[ $(field bytes "$cout") == "$(field bytes "$sout")" ]] || return 1
  [[ $(field path "$cout") == san-verbs && $(field path "$sout") == san-verbs ]]
}

# memory_case NAME ROUNDS [VAR=VALUE…]
memory_case() {
  local name=$1 rounds=$2 ok=1 line; shift 2
  mode_env=("$@")
  pair "$name" $((1 << 20)) client $((1 << 20)) "$rounds" "${VARIANTS[@]}"
  delivered || ok=0
  for variant in "${VARIANTS[@]}"; do
    line=$(grep "^client variant=$variant " "$LOGS/$name.client.out")
    if [[ $variant == brk ]]; then
      # The heap top is shared with every small allocation in the process (the preload's
      # threads included), so a round may find its block moved above one; each byte is still
      # checked, and at least one round must reuse the address for the case to mean anything.
      (( $(field same_address "$line") >= 1 )) 2>/dev/null || ok=0
    else
      [[ $(field same_address "$line") == $((rounds - 1)) ]] || ok=0
    fi
    [[ $(field changed "$line") == $((rounds - 1)) ]] || ok=0
    [[ $(field rdv_rounds "$line") == "$rounds" ]] || ok=0
  done
  # The heap variant: free() did lower the break (in other rounds malloc_trim gave the pages
  # back with MADV_DONTNEED; each counts as changed).
  (( $(field brk_shrinks "$(grep "^client variant=brk " "$LOGS/$name.client.out")") >= 1 )) 2>/dev/null || ok=0
  (( $(field rdv_received "$sout") > 0 )) 2>/dev/null || ok=0
  report "$name" "$ok" "${#VARIANTS[@]} variants x $rounds rounds of 1 MiB, each from new memory at the same address, all by rendezvous; $(field bytes "$sout") bytes checked, server rdv_received=$(field rdv_received "$sout") same_address=$(field same_address "$sout")/$(field buffers "$sout"), $(grep -o 'brk_shrinks=[0-9]*' "$LOGS/$name.client.out")"
  mode_env=()
}

# enobufs_case NAME SIDE: SIDE (client or server) runs under the memory lock limit.
enobufs_case() {
  local name=$1 side=$2 ok=1
  # (debug: the receiver's log names the refusal)
  mode_env=(SANDIRECT_LOG=debug)
  # Large sends until one is refused or goes by rendezvous: the first may still find the
  # session being set up (inline); with the receiver limited every one goes inline, so fewer.
  # The limited receiver reads into 8 MiB: what is left of it after the inline bytes (at most
  # 4.6 MiB) is still more than the limit leaves to pin, so every sink is refused.
  local attempts=4 buffer=$((2 << 20))
  if [[ $side == client ]]; then
    client_prefix=("${limited[@]}")
  else
    server_prefix=("${limited[@]}"); attempts=3; buffer=$((8 << 20))
  fi
  pair "$name" "$buffer" enobufs $((3 << 19)) "$attempts"
  mode_env=(); client_prefix=(); server_prefix=()
  delivered || ok=0
  if [[ $side == client ]]; then
    [[ $(field enobufs "$cout") -ge 1 && $(field rendezvous_sends "$cout") == 0 ]] 2>/dev/null || ok=0
  else
    # Not refused; the receiver turned the rendezvous down (its log says why), so nothing
    # went by rendezvous.
    [[ $(field enobufs "$cout") == 0 && $(field inline_large_sends "$cout") -ge 1 &&
       $(field rdv_received "$sout") == 0 ]] 2>/dev/null || ok=0
    grep -q "rendezvous receive: registration refused" "$LOGS/$name.server.err" || ok=0
  fi
  report "$name" "$ok" "$(field enobufs "$cout") sends refused with ENOBUFS, $(field rendezvous_sends "$cout") by rendezvous, $(field inline_large_sends "$cout") inline; $(field bytes "$sout") bytes received and checked"
}

# connections_case NAME CONNECTIONS SIDE: see connections-memlock above; SIDE (client or
# server) runs under the limit.
connections_case() {
  local name=$1 conns=$2 side=$3 bytes=$((1 << 20)) ok=1
  if [[ $side == client ]]; then client_prefix=("${limited[@]}"); else server_prefix=("${limited[@]}"); fi
  server_cmd=("$X" multi-server "$S" "$conns")
  client_cmd=("$X" multi-client "$S:@PORT@" "$C" "$conns" "$bytes")
  run_pair "$name"
  client_prefix=(); server_prefix=()
  [[ $crc == 0 && $src == 0 ]] || ok=0
  [[ $cout == "client all ok conns=$conns "* && $sout == "server all ok conns=$conns "* ]] || ok=0
  local csan ctcp
  csan=$(field san "$cout"); ctcp=$(field tcp "$cout")
  # Some connections on the SAN, the others held back by the limit; both sides agree.
  (( csan >= 1 && ctcp >= 1 )) 2>/dev/null || ok=0
  [[ $csan == "$(field san "$sout")" ]] || ok=0
  # Every connection's echo intact (the client checked it) and the server got each byte once.
  local sums
  sums=$(grep -ho "^[a-z]* ok bytes=$bytes checksum=[0-9a-f]*" "$LOGS/$name.client.out" "$LOGS/$name.server.out" |
         sed 's/.*checksum=//' | sort -u)
  [[ $(grep -c "^client ok bytes=$bytes " "$LOGS/$name.client.out") == "$conns" &&
     $(grep -c "^server ok bytes=$bytes " "$LOGS/$name.server.out") == "$conns" &&
     $(wc -l <<<"$sums") == 1 ]] || ok=0
  # The limited side's TCP connections say why: its own want of resources.
  local reasons
  reasons=$(grep "^$side ok .* path=tcp " "$LOGS/$name.$side.out" | sed 's/.*reason=//' | sort | uniq -c | tr -s ' ' | tr '\n' ',')
  [[ $reasons == " $ctcp san-resources," ]] || ok=0
  report "$name" "$ok" "$conns connections, the $side under a 2 MiB memlock limit: $csan on the SAN, $ctcp on TCP (the $side's reasons:$reasons), every 1 MiB echo intact"
}

# READ mode (the default over rxe, asked for with SANDIRECT_SAN_RDMA_READ=1 over siw, whose
# default is WRITE mode): the receiver reads the sender's buffer through an
# rkey, and every rendezvous exposes the cached registration anew (a new pin of the pages there
# now), so invalidation is not what keeps it right. WRITE mode: the sender writes from its
# cached registration with local rights only; only the invalidation keeps it off old pages.
selected memory-changes-read && memory_case memory-changes-read $(( ROUNDS < 2 ? ROUNDS : 2 )) SANDIRECT_SAN_RDMA_READ=1
selected memory-changes-write && memory_case memory-changes-write "$ROUNDS" SANDIRECT_SAN_RDMA_READ=0
selected enobufs-memlock && enobufs_case enobufs-memlock client
selected receiver-memlock && enobufs_case receiver-memlock server
selected connections-memlock && connections_case connections-memlock 4 client
selected acceptor-connections-memlock && connections_case acceptor-connections-memlock 4 server
echo "san-verbs-memory: $pass passed, $fail failed"
[[ $fail == 0 ]]
