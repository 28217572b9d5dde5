#!/usr/bin/env bash
# run-in-vm.sh - run one command inside a throw-away QEMU guest that has two
# software RDMA devices (soft-RoCE rdma_rxe, or soft-iWARP siw), and exit with
# the command's status.
#
#   usage: run-in-vm.sh [--siw] [--mode wire|single] [--setup] [--] CMD [ARGS...]
#          run-in-vm.sh [--siw] --mode link --host 1|2 --link LOCAL:REMOTE [--] CMD [ARGS...]
#
#   --siw          use soft-iWARP (siw0/siw1) instead of soft-RoCE (rxe0/rxe1)
#   --mode wire    (default) "two hosts": DEV0 on veth0 192.0.2.1 and DEV1 on
#                  veth1 192.0.2.2, with policy routing so that traffic between
#                  the two addresses really crosses the veth pair
#   --mode single  one device on veth0 192.0.2.1 (the driver's loopback path)
#   --mode link    one guest of two: one virtio NIC, eth0, 192.0.2.N/24 and
#                  2001:db8::N/64 for --host N, with DEV0 on it; the NIC is
#                  joined to the other guest's by a QEMU datagram link between
#                  UDP ports LOCAL and REMOTE of 127.0.0.1 (--link LOCAL:REMOTE,
#                  the other guest started with REMOTE:LOCAL). Two kernels, two
#                  RDMA stacks: what a real pair of hosts is to the preload.
#   --setup        only install packages, fetch the kernel, build the initramfs
#                  (and siw.ko with --siw); do not boot
#
# Why a VM: the development/CI kernel has no CONFIG_INFINIBAND and no module
# loading, so the drivers run in a guest booted from Debian's stock kernel
# package (downloaded and unpacked into the cache, never installed on the
# host) under TCG.  The guest reuses the host userland: /usr and /etc are
# shared read-only over virtio-9p, the project directory read-write at the
# same path, so host-built binaries (glibc, libibverbs, librdmacm) run as they
# are.  The guest has no NIC (--mode link: one, whose only peer is the other
# guest, through 127.0.0.1): nothing it does can reach any network.
#
# Inside, the command runs as root with cwd = the host cwd and sees
#   SANDIRECT_VM=1 SANDIRECT_VM_FABRIC=rxe|siw SANDIRECT_VM_MODE=wire|single
#   SANDIRECT_TEST_DEVICE=<dev0> SANDIRECT_TEST_SERVER_IP=192.0.2.1
#   SANDIRECT_TEST_CLIENT_IP=192.0.2.2 (wire) or 192.0.2.1 (single)
#   and in wire mode the same two hosts over IPv6: SANDIRECT_TEST_SERVER_IP6=2001:db8::1
#   SANDIRECT_TEST_CLIENT_IP6=2001:db8::2; in link mode the same addresses (host 1
#   is the server's, host 2 the client's) and SANDIRECT_VM_HOST=N
#
# Exit status: the command's; 124 when the guest timed out; 125 when the
# harness or the guest failed before the command reported a status.
#
# Environment knobs (all optional):
#   SANDIRECT_VM_CACHE    cache dir (${XDG_CACHE_HOME:-$HOME/.cache}/sandirect-softroce)
#   SANDIRECT_VM_TIMEOUT  seconds before the guest is killed            (600)
#   SANDIRECT_VM_MEM      guest RAM in MiB                              (2048)
#   SANDIRECT_VM_SMP      guest vCPUs                                   (2)
#   SANDIRECT_VM_SHARE    ':'-separated extra dirs shared read-write    ("")
#   SANDIRECT_VM_PASSENV  extra variable names passed into the guest
#                         (RUST_*, CARGO_*, SANDIRECT_* are always passed)
#   SANDIRECT_VM_VERBOSE  1 = print timings, and the console on failure
set -euo pipefail

die() { echo "run-in-vm: $*" >&2; exit 125; }
say() { [[ "${SANDIRECT_VM_VERBOSE:-0}" == 1 ]] && echo "run-in-vm: $*" >&2 || true; }

FABRIC=rxe; MODE=wire; SETUP_ONLY=0; HOST=""; LINK=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --siw) FABRIC=siw; shift ;;
    --rxe) FABRIC=rxe; shift ;;
    --mode) [[ $# -ge 2 ]] || die "--mode needs wire|single"; MODE=$2; shift 2 ;;
    --setup) SETUP_ONLY=1; shift ;;
    --host) [[ $# -ge 2 ]] || die "--host needs 1 or 2"; HOST=$2; shift 2 ;;
    --link) [[ $# -ge 2 ]] || die "--link needs LOCAL:REMOTE"; LINK=$2; shift 2 ;;
    -h|--help) sed -n '2,51p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $MODE == wire || $MODE == single || $MODE == link ]] || die "--mode must be wire, single or link"
if [[ $MODE == link ]]; then
  [[ $HOST == 1 || $HOST == 2 ]] || die "--mode link needs --host 1 or 2"
  [[ $LINK =~ ^[0-9]+:[0-9]+$ ]] || die "--mode link needs --link LOCAL_PORT:REMOTE_PORT"
fi
[[ $SETUP_ONLY == 1 || $# -gt 0 ]] || die "usage: $0 [--siw] [--mode wire|single] [--setup] [--] CMD [ARGS...]"

CACHE=${SANDIRECT_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sandirect-softroce}
mkdir -p "$CACHE"
# One-time setup is serialised between concurrent runs; the lock is dropped
# before boot so that several guests may run side by side.
exec 9>"$CACHE/.setup.lock"
flock 9

apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@"; }
APT_UPDATED=0
apt_update_once() { [[ $APT_UPDATED == 1 ]] || { apt_get update -qq >&2; APT_UPDATED=1; }; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# ---------------------------------------------------------------- packages
# qemu-system-x86: the emulator; busybox-static: the guest's init; cpio/xz:
# initramfs and kernel unpacking; kmod: modprobe against the unpacked module
# tree; iproute2: ip + rdma; rdma-core & co: the userspace verbs providers
# (librxe, libsiw) that the guest uses through the shared /usr.
missing=()
for p in qemu-system-x86 busybox-static cpio xz-utils kmod iproute2 rdma-core \
         ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils rdmacm-utils perftest; do
  installed "$p" || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  say "installing ${missing[*]}"
  had_qemu_img=0; command -v qemu-img >/dev/null && had_qemu_img=1
  apt_update_once
  apt_get install -y -qq --no-install-recommends "${missing[@]}" >&2
  # A newer qemu-utils from backports conflicts with Debian 12's
  # qemu-system-x86 and apt removes it: give qemu-img back to whoever had it.
  if [[ $had_qemu_img == 1 ]] && ! command -v qemu-img >/dev/null; then
    apt_get install -y -qq --no-install-recommends qemu-utils >&2
  fi
fi

# ------------------------------------------------------------ guest kernel
if [[ -s "$CACHE/kernel-package" ]]; then
  KPKG=$(cat "$CACHE/kernel-package")
else
  resolve() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
  KPKG=$(resolve)
  [[ -n "$KPKG" ]] || { apt_update_once; KPKG=$(resolve); }
  # The -cloud- flavour has no rdma_rxe; the generic amd64 one has.
  [[ -n "$KPKG" && "$KPKG" != *cloud* ]] || die "cannot resolve a linux-image-*-amd64 package"
  echo "$KPKG" > "$CACHE/kernel-package"
fi
KROOT="$CACHE/$KPKG"
if [[ ! -f "$KROOT/.complete" ]]; then
  say "downloading $KPKG (unpacked only, never installed)"
  rm -rf "$KROOT" "$CACHE/download"; mkdir -p "$KROOT" "$CACHE/download"
  ( cd "$CACHE/download" && { apt-get download "$KPKG" >&2 || { apt_update_once; apt-get download "$KPKG" >&2; }; } )
  dpkg -x "$CACHE"/download/*.deb "$KROOT"
  rm -rf "$CACHE/download"
  touch "$KROOT/.complete"
fi
KVER=$(ls "$KROOT/lib/modules" | head -n 1)
BZIMAGE="$KROOT/boot/vmlinuz-$KVER"
[[ -f "$BZIMAGE" ]] || die "no kernel image in $KROOT"
# Under TCG, decompressing the bzImage costs seconds per boot. Debian kernels
# are built with CONFIG_PVH, so QEMU can boot the uncompressed ELF directly:
# extract it once (the payload is the first xz stream inside the bzImage).
VMLINUX="$KROOT/boot/vmlinux-$KVER"
if [[ ! -s "$VMLINUX" ]]; then
  offset=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$BZIMAGE" | head -n 1 | cut -d: -f1 || true)
  tmp=$(mktemp "$VMLINUX.XXXXXX")
  if [[ -n "$offset" ]] && xz -dc --single-stream < <(tail -c +$((offset + 1)) "$BZIMAGE") > "$tmp" 2>/dev/null \
     && [[ "$(head -c 4 "$tmp" | od -An -tx1 | tr -d ' ')" == 7f454c46 ]]; then
    mv "$tmp" "$VMLINUX"
  else
    rm -f "$tmp"; say "no vmlinux extracted; booting the bzImage"
  fi
fi
KERNEL=$BZIMAGE; [[ -s "$VMLINUX" ]] && KERNEL=$VMLINUX
MODTREE="$KROOT/lib/modules/$KVER"

# ------------------------------------------------------------ siw.ko
# Debian builds its kernels without CONFIG_RDMA_SIW, so soft-iWARP is built
# once, out of tree, from the matching linux-source tarball (only its
# drivers/infiniband/sw/siw directory) against the matching linux-headers.
if [[ $FABRIC == siw && ! -s "$MODTREE/extra/siw.ko" ]]; then
  say "building siw.ko for $KVER"
  XY=$(echo "$KVER" | cut -d. -f1,2)
  if [[ ! -d "/usr/src/linux-headers-$KVER" ]]; then
    apt_get install -y -qq --no-install-recommends "linux-headers-$KVER" make gcc >&2 ||
      { apt_update_once; apt_get install -y -qq --no-install-recommends "linux-headers-$KVER" make gcc >&2; }
  fi
  build=$(mktemp -d)
  ( cd "$build" && { apt-get download "linux-source-$XY" >&2 || { apt_update_once; apt-get download "linux-source-$XY" >&2; }; } )
  dpkg -x "$build"/linux-source-*.deb "$build/pkg"
  tar -xJf "$build/pkg/usr/src/linux-source-$XY.tar.xz" -C "$build" "linux-source-$XY/drivers/infiniband/sw/siw"
  src="$build/linux-source-$XY/drivers/infiniband/sw/siw"
  make -s -C "/usr/src/linux-headers-$KVER" M="$src" CONFIG_RDMA_SIW=m modules -j"$(nproc)" >&2
  mkdir -p "$MODTREE/extra"
  strip --strip-debug -o "$MODTREE/extra/siw.ko" "$src/siw.ko"
  rm -f "$MODTREE/modules.dep"
  rm -rf "$build"
fi
[[ -f "$MODTREE/modules.dep" ]] || depmod -b "$KROOT" "$KVER"

# ------------------------------------------------------------ initramfs
# Holds only busybox, our /init and the modules needed to mount 9p; every
# other module is loaded in the guest by the host's modprobe from the unpacked
# module tree (shared read-only), which is also the kernel's request_module
# helper so on-demand loads work.
INITRD="$CACHE/initramfs-$KVER.cpio.gz"
STAMP=$(cat "$0" "$KERNEL" | md5sum | cut -c1-16)
if [[ ! -s "$INITRD" || "$(cat "$INITRD.stamp" 2>/dev/null)" != "$STAMP" ]]; then
  say "building $INITRD"
  work=$(mktemp -d)
  root="$work/root"
  mkdir -p "$root"/{bb,boot,job,modtree,proc,sys,dev,usr,etc,tmp,run,root,var/tmp}
  cp /bin/busybox "$root/bb/busybox"
  for applet in $("$root/bb/busybox" --list); do
    [[ $applet == busybox ]] || ln -s busybox "$root/bb/$applet"
  done
  for link in /bin /sbin /lib /lib32 /lib64 /libx32; do   # Debian 12 is usr-merged
    [[ -L "$link" ]] && ln -s "$(readlink "$link")" "$root$link"
  done
  : > "$root/boot/order"
  for m in virtio_pci 9pnet_virtio 9p; do
    modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1 == "insmod" {print $2}' |
    while read -r ko; do
      name=${ko##*/}; name=${name%.xz}; name=${name%.zst}
      grep -qxF "/boot/$name" "$root/boot/order" && continue
      case "$ko" in
        *.xz) xz -dc "$ko" > "$root/boot/$name" ;;
        *.zst) zstd -qdc "$ko" > "$root/boot/$name" ;;
        *) cp "$ko" "$root/boot/$name" ;;
      esac
      echo "/boot/$name" >> "$root/boot/order"
    done
  done
  printf '#!/bb/sh\nexec /usr/sbin/modprobe -d /modtree "$@"\n' > "$root/boot/modprobe"
  chmod +x "$root/boot/modprobe"
  cat > "$root/init" <<'INIT'
#!/bb/sh
# PID 1 of the guest: mount, load modules, set up the fabric, run the job,
# report its status through the shared job directory, power off.
export PATH=/usr/sbin:/usr/bin:/bb
bb=/bb
$bb/mount -t proc proc /proc
$bb/mount -t sysfs sysfs /sys
$bb/mount -t devtmpfs devtmpfs /dev
$bb/mkdir -p /dev/pts /dev/shm
$bb/mount -t devpts devpts /dev/pts
$bb/mount -t tmpfs tmpfs /dev/shm
for d in /tmp /run /root /var/tmp; do $bb/mount -t tmpfs tmpfs $d; done
$bb/chmod 1777 /tmp /var/tmp /dev/shm
fail() { echo "guest-init: $*"; echo 125 > /job/rc; $bb/sync; $bb/poweroff -f; }
while read -r ko; do $bb/insmod "$ko" || echo "guest-init: insmod $ko failed"; done < /boot/order
o=trans=virtio,version=9p2000.L,msize=512000
$bb/mount -t 9p -o $o,cache=mmap job /job || fail "mount job"
$bb/mount -t 9p -o $o,ro,cache=loose usr /usr || fail "mount usr"
$bb/mount -t 9p -o $o,ro,cache=loose etc /etc || fail "mount etc"
$bb/mount -t 9p -o $o,ro,cache=loose modtree /modtree || fail "mount modtree"
echo /boot/modprobe > /proc/sys/kernel/modprobe
/usr/sbin/modprobe -a -d /modtree $(cat /job/modules) || fail "modprobe $(cat /job/modules)"
while read -r tag path; do
  [ -n "$tag" ] || continue
  $bb/mkdir -p "$path" && $bb/mount -t 9p -o $o,cache=mmap "$tag" "$path" || fail "mount $path"
done < /job/shares
/bin/bash -ex /job/fabric.sh > /job/fabric.log 2>&1 || fail "fabric setup: $($bb/cat /job/fabric.log)"
echo "guest-init: ready uptime=$($bb/cut -d' ' -f1 /proc/uptime)"
/bin/bash /job/command.sh > /job/stdout 2> /job/stderr < /dev/null
echo $? > /job/rc.tmp && $bb/mv /job/rc.tmp /job/rc
echo "guest-init: done uptime=$($bb/cut -d' ' -f1 /proc/uptime)"
$bb/sync
$bb/poweroff -f
INIT
  chmod +x "$root/init"
  tmp=$(mktemp "$INITRD.XXXXXX")
  ( cd "$root" && find . | cpio -o -H newc --quiet ) | gzip -1 > "$tmp"
  mv "$tmp" "$INITRD"; echo "$STAMP" > "$INITRD.stamp"
  rm -rf "$work"
fi
if [[ $SETUP_ONLY == 1 ]]; then echo "run-in-vm: setup done ($FABRIC, kernel $KVER)" >&2; exit 0; fi
flock -u 9; exec 9>&-

# ------------------------------------------------------------ job directory
JOB=$(mktemp -d "${TMPDIR:-/tmp}/sandirect-vm.XXXXXX")
QEMU_PID=""; TAIL_PIDS=()
cleanup() {
  [[ -n "$QEMU_PID" ]] && kill "$QEMU_PID" 2>/dev/null
  for p in "${TAIL_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  rm -rf "$JOB"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

NIC_MODULE=veth; [[ $MODE == link ]] && NIC_MODULE=virtio_net
echo "$NIC_MODULE ib_uverbs rdma_ucm $([[ $FABRIC == rxe ]] && echo rdma_rxe || echo siw)" > "$JOB/modules"

DEV0=${FABRIC}0; DEV1=${FABRIC}1
{
  if [[ $MODE == wire ]]; then
    # Two devices in one network namespace whose packets cross the veth pair.
    # By default traffic between two local addresses is delivered through lo
    # (and the RDMA driver then finds no device for it), hence:
    #  - /32 addresses and the "local" rule moved from pref 0 to pref 100;
    #  - pref 10/11: locally generated packets (iif lo) towards the OTHER
    #    address leave through our own veth end;
    #  - pref 12/13: the same keyed by oif, because rdma_cm validates the
    #    return path with an oif-based lookup and rejects the connect otherwise;
    #  - accept_local=1, rp_filter=0: accept packets whose source address is
    #    local when they arrive on the other veth end.
    # (A second network namespace does not work: the 6.1 rxe opens its UDP
    # socket and routes in the initial namespace only.)
    cat <<'NET'
ip -batch - <<'IP'
link set lo up
link add veth0 type veth peer name veth1
addr add 192.0.2.1/32 dev veth0
addr add 192.0.2.2/32 dev veth1
rule add pref 10 to 192.0.2.2 iif lo lookup 102
rule add pref 11 to 192.0.2.1 iif lo lookup 101
rule add pref 12 to 192.0.2.2 oif veth0 lookup 102
rule add pref 13 to 192.0.2.1 oif veth1 lookup 101
rule add pref 100 lookup local
rule del pref 0
link set veth0 up
link set veth1 up
route add 192.0.2.2 dev veth0 src 192.0.2.1 table 102
route add 192.0.2.1 dev veth1 src 192.0.2.2 table 101
IP
for i in all default veth0 veth1; do
  echo 1 > /proc/sys/net/ipv4/conf/$i/accept_local
  echo 0 > /proc/sys/net/ipv4/conf/$i/rp_filter
done
# The same two hosts over IPv6 (documentation prefix; nodad: usable at once). IPv6 has no
# accept_local or rp_filter to relax.
ip -6 -batch - <<'IP'
addr add 2001:db8::1/128 dev veth0 nodad
addr add 2001:db8::2/128 dev veth1 nodad
rule add pref 10 to 2001:db8::2 iif lo lookup 102
rule add pref 11 to 2001:db8::1 iif lo lookup 101
rule add pref 12 to 2001:db8::2 oif veth0 lookup 102
rule add pref 13 to 2001:db8::1 oif veth1 lookup 101
rule add pref 100 lookup local
rule del pref 0
route add 2001:db8::2 dev veth0 src 2001:db8::1 table 102
route add 2001:db8::1 dev veth1 src 2001:db8::2 table 101
IP
NET
    echo "rdma link add $DEV0 type $FABRIC netdev veth0"
    echo "rdma link add $DEV1 type $FABRIC netdev veth1"
  elif [[ $MODE == link ]]; then
    # One NIC (no udev in the guest: the kernel's name, eth0), on a subnet whose only other
    # host is the other guest. Neighbour discovery runs over the link as between machines.
    cat <<NET
for _ in \$(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
ip -batch - <<'IP'
link set lo up
addr add 192.0.2.$HOST/24 dev eth0
addr add 2001:db8::$HOST/64 dev eth0 nodad
link set eth0 up
IP
NET
    echo "rdma link add $DEV0 type $FABRIC netdev eth0"
  else
    cat <<'NET'
ip -batch - <<'IP'
link set lo up
link add veth0 type veth peer name veth1
addr add 192.0.2.1/24 dev veth0
link set veth0 up
link set veth1 up
IP
NET
    echo "rdma link add $DEV0 type $FABRIC netdev veth0"
  fi
} > "$JOB/fabric.sh"

CLIENT_IP=192.0.2.2; [[ $MODE == single ]] && CLIENT_IP=192.0.2.1
NET_ARGS=(-nic none)
if [[ $MODE == link ]]; then
  # A point-to-point datagram link between the two QEMU processes: each sends its frames to
  # the other's UDP port on 127.0.0.1 and receives on its own. Nothing leaves the machine.
  NET_ARGS=(-netdev "dgram,id=link,local.type=inet,local.host=127.0.0.1,local.port=${LINK%%:*},remote.type=inet,remote.host=127.0.0.1,remote.port=${LINK##*:}"
            -device "virtio-net-pci,netdev=link,mac=52:54:00:00:02:0$HOST")
fi
{
  names="PATH HOME USER LOGNAME LANG LC_ALL TERM ${SANDIRECT_VM_PASSENV:-}"
  for v in $(compgen -e); do
    case "$v" in RUST_*|CARGO_*|SANDIRECT_*) names="$names $v" ;; esac
  done
  for v in $names; do [[ -n "${!v+x}" ]] && printf 'export %s=%q\n' "$v" "${!v}"; done
  printf 'export SANDIRECT_VM=1 SANDIRECT_VM_FABRIC=%q SANDIRECT_VM_MODE=%q\n' "$FABRIC" "$MODE"
  printf 'export SANDIRECT_TEST_DEVICE=%q SANDIRECT_TEST_SERVER_IP=192.0.2.1 SANDIRECT_TEST_CLIENT_IP=%q\n' "$DEV0" "$CLIENT_IP"
  [[ $MODE == wire || $MODE == link ]] && echo 'export SANDIRECT_TEST_SERVER_IP6=2001:db8::1 SANDIRECT_TEST_CLIENT_IP6=2001:db8::2'
  [[ $MODE == link ]] && printf 'export SANDIRECT_VM_HOST=%q\n' "$HOST"
  # Registration pins pages; the job gets no limit unless a test sets one.
  echo 'ulimit -l unlimited 2>/dev/null || true'
  printf 'cd %q || exit 125\n' "$PWD"
  printf 'exec'; printf ' %q' "$@"; printf '\n'
} > "$JOB/command.sh"

# Shares: /usr, /etc and the kernel module tree read-only; the current
# directory (and SANDIRECT_VM_SHARE) read-write at the same path.
SHARES=(-virtfs "local,path=$JOB,mount_tag=job,security_model=none,multidevs=remap"
        -virtfs "local,path=/usr,mount_tag=usr,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=/etc,mount_tag=etc,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=$KROOT,mount_tag=modtree,security_model=none,readonly=on,multidevs=remap")
: > "$JOB/shares"
n=0
IFS=: read -r -a extra <<< "${SANDIRECT_VM_SHARE:-}"
while read -r dir; do
  [[ -n "$dir" ]] || continue
  case "$dir" in /|/usr|/usr/*|/etc|/etc/*|/proc|/proc/*|/sys|/sys/*|/dev|/dev/*) die "refusing to share $dir" ;; esac
  n=$((n + 1))
  SHARES+=(-virtfs "local,path=${dir//,/,,},mount_tag=rw$n,security_model=none,multidevs=remap")
  echo "rw$n $dir" >> "$JOB/shares"
done < <(for d in "$PWD" "${extra[@]}"; do [[ -n "$d" ]] && realpath -e "$d"; done | LC_ALL=C sort -u)

# ------------------------------------------------------------ boot
# /dev/kvm here is a PVM hypervisor that cannot run a stock kernel: TCG only.
# q35 + the PVH vmlinux + mitigations=off boot fastest under TCG.
touch "$JOB/stdout" "$JOB/stderr"
t0=$(date +%s.%N)
timeout --kill-after=5 "${SANDIRECT_VM_TIMEOUT:-600}" \
  qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m "${SANDIRECT_VM_MEM:-2048}" -smp "${SANDIRECT_VM_SMP:-2}" \
    -machine q35 -nodefaults -no-user-config -display none -monitor none "${NET_ARGS[@]}" -no-reboot \
    -serial "file:$JOB/console.log" -kernel "$KERNEL" -initrd "$INITRD" \
    -append "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off rdinit=/init" \
    "${SHARES[@]}" > "$JOB/qemu.log" 2>&1 &
QEMU_PID=$!
tail -s 0.2 -f -c +1 --pid="$QEMU_PID" "$JOB/stdout" & TAIL_PIDS+=($!)
tail -s 0.2 -f -c +1 --pid="$QEMU_PID" "$JOB/stderr" >&2 & TAIL_PIDS+=($!)
set +e; wait "$QEMU_PID"; qemu_rc=$?; set -e
QEMU_PID=""
for p in "${TAIL_PIDS[@]}"; do wait "$p" 2>/dev/null; done; TAIL_PIDS=()
t1=$(date +%s.%N)
say "$FABRIC/$MODE${HOST:+ $HOST}: qemu exit $qemu_rc after $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s; $(grep -a 'guest-init:' "$JOB/console.log" | tr '\n' ' ')"
if [[ -s "$JOB/rc" ]]; then
  rc=$(cat "$JOB/rc")
elif [[ $qemu_rc == 124 || $qemu_rc == 137 ]]; then
  echo "run-in-vm: guest timed out after ${SANDIRECT_VM_TIMEOUT:-600} s" >&2; rc=124
else
  echo "run-in-vm: guest stopped without a status (qemu exit $qemu_rc)" >&2; rc=125
fi
if [[ $rc == 125 || ( $rc != 0 && "${SANDIRECT_VM_VERBOSE:-0}" == 1 ) ]]; then
  { echo "---- qemu.log"; cat "$JOB/qemu.log"; echo "---- console.log (tail)"; tail -n 40 "$JOB/console.log"; } >&2
fi
exit "$rc"
