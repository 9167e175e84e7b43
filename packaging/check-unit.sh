#!/usr/bin/env bash
# Check the systemd unit and its sysusers.d/tmpfiles.d companions.
#
#   packaging/check-unit.sh [--binary PATH] [--man-dir DIR] [--root DIR] [UNIT]
#
# UNIT       the unit file (default: systemd/robota-mcpd.service)
# --binary   a built robota-mcpd (default: $CARGO_TARGET_DIR/dist/robota-mcpd). The unit is
#            verified as a copy whose ExecStart names this file, because systemd-analyze
#            verify refuses an ExecStart binary that does not exist, and this machine has
#            no /usr/bin/robota-mcpd (ExecReload= likewise names robota-mcpctl beside it).
# --man-dir  a man tree (man1/, man8/): verify then also checks that every man: page in
#            Documentation= exists there. Without it, man pages are not checked.
# --root     an unpacked package tree holding usr/lib/sysusers.d/robota-mcpd.conf and
#            usr/lib/tmpfiles.d/robota-mcpd.conf; without it, the files in systemd/ are
#            laid out in a scratch tree.
#
# Asserts: the directives the daemon's contract depends on are present; `systemd-analyze
# verify` prints nothing about the unit; `systemd-analyze security --offline=true` rates its
# overall exposure at most $MAX_EXPOSURE (default 2.5); systemd-sysusers creates the user
# and group in a scratch root, and systemd-tmpfiles then creates the state directory there
# 0700 and owned by that user.
set -euo pipefail
cd "$(dirname "$0")/.."

MAX_EXPOSURE=${MAX_EXPOSURE:-2.5}
target_dir=${CARGO_TARGET_DIR:-target}
unit=systemd/robota-mcpd.service
binary=$target_dir/dist/robota-mcpd
man_dir=
root=
while (($#)); do
	case $1 in
	--binary) binary=$2 && shift 2 ;;
	--man-dir) man_dir=$2 && shift 2 ;;
	--root) root=$2 && shift 2 ;;
	-*) echo "check-unit: unknown option $1" >&2 && exit 2 ;;
	*) unit=$1 && shift ;;
	esac
done

failures=0
fail() {
	echo "check-unit: FAIL: $*" >&2
	failures=$((failures + 1))
}
[[ -f $unit ]] || { echo "check-unit: no unit file $unit" >&2 && exit 1; }
[[ -x $binary ]] || { echo "check-unit: no executable $binary (build it first)" >&2 && exit 1; }
binary=$(realpath "$binary")
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "-- $unit: required settings"
# Exact lines: the daemon's contract (readiness, watchdog, exit code 78, reload, the
# directories it reads from the environment) and the hardening floor.
for line in \
	'Type=notify' \
	'NotifyAccess=main' \
	'ExecStart=/usr/bin/robota-mcpd' \
	'ExecReload=/usr/bin/robota-mcpctl reload' \
	'Restart=on-failure' \
	'RestartPreventExitStatus=78' \
	'User=robota-mcpd' \
	'Group=robota-mcpd' \
	'RuntimeDirectory=robota-mcpd' \
	'StateDirectory=robota-mcpd' \
	'ConfigurationDirectory=robota-mcpd' \
	'UMask=0077' \
	'ProtectSystem=strict' \
	'ProtectHome=yes' \
	'PrivateTmp=yes' \
	'PrivateDevices=yes' \
	'NoNewPrivileges=yes' \
	'CapabilityBoundingSet=' \
	'AmbientCapabilities=' \
	'RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6' \
	'SystemCallArchitectures=native' \
	'SystemCallFilter=@system-service' \
	'SystemCallFilter=landlock_create_ruleset landlock_add_rule landlock_restrict_self' \
	'WantedBy=multi-user.target'; do
	grep -qxF -- "$line" "$unit" || fail "missing line: $line"
done
# Seconds, whether written 30, 30s or 1min.
seconds() {
	local v
	v=$(grep -E "^$1=" "$unit" | tail -n 1 | cut -d= -f2-)
	case $v in
	*min) echo $((${v%min} * 60)) ;;
	*s) echo "${v%s}" ;;
	'') echo 0 ;;
	*) echo "$v" ;;
	esac
}
# The daemon bounds its own start to 15 s; systemd must wait longer than that.
(($(seconds TimeoutStartSec) > 15)) || fail "TimeoutStartSec must exceed the daemon's 15 s start bound"
(($(seconds WatchdogSec) > 0)) || fail "WatchdogSec= is not set"

# ExecReload= runs robota-mcpctl, built next to the daemon.
ctl=$(dirname "$binary")/robota-mcpctl
[[ -x $ctl ]] || { echo "check-unit: no executable $ctl (build it first)" >&2 && exit 1; }
echo "-- systemd-analyze verify (ExecStart=$binary, ExecReload=$ctl reload)"
mkdir -p "$scratch/unit"
copy=$scratch/unit/$(basename "$unit")
sed -e "s|^ExecStart=/usr/bin/robota-mcpd\$|ExecStart=$binary|" \
	-e "s|^ExecReload=/usr/bin/robota-mcpctl reload\$|ExecReload=$ctl reload|" "$unit" >"$copy"
grep -qxF "ExecStart=$binary" "$copy" || fail "could not point ExecStart at $binary"
grep -qxF "ExecReload=$ctl reload" "$copy" || fail "could not point ExecReload at $ctl"
if [[ -n $man_dir ]]; then
	verify=(env MANPATH="$(realpath "$man_dir")" systemd-analyze verify --man=yes "$copy")
else
	echo "   (no --man-dir: Documentation= man pages not checked)"
	verify=(systemd-analyze verify --man=no "$copy")
fi
# verify exits 0 on warnings such as an unknown key: any line about our unit is a failure.
# Lines about the host's own units are shown but do not count.
status=0
output=$("${verify[@]}" 2>&1) || status=$?
[[ -z $output ]] || printf '   %s\n' "$output"
((status == 0)) || fail "systemd-analyze verify exited $status"
if grep -q -e robota-mcpd -e "$scratch" <<<"$output"; then
	fail "systemd-analyze verify reported problems with the unit"
fi

echo "-- systemd-analyze security --offline=true (at most $MAX_EXPOSURE)"
report=$(systemd-analyze security --offline=true --no-pager "$copy" 2>&1) || true
exposure=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9][0-9.]*\).*/\1/p' <<<"$report")
if [[ -z $exposure ]]; then
	printf '%s\n' "$report"
	fail "no overall exposure level in the security report"
else
	# What is still exposed, for the log.
	grep '✗' <<<"$report" | sed 's/^/   /' || true
	echo "   overall exposure level: $exposure"
	awk -v e="$exposure" -v max="$MAX_EXPOSURE" 'BEGIN { exit !(e <= max) }' ||
		fail "exposure $exposure is above $MAX_EXPOSURE"
fi

echo "-- sysusers.d and tmpfiles.d in a scratch root"
if [[ -z $root ]]; then
	root=$scratch/root
	install -D -m 0644 systemd/robota-mcpd.sysusers "$root/usr/lib/sysusers.d/robota-mcpd.conf"
	install -D -m 0644 systemd/robota-mcpd.tmpfile "$root/usr/lib/tmpfiles.d/robota-mcpd.conf"
	mkdir -p "$root/etc"
else
	# Work on a copy: the caller's tree stays as unpacked.
	cp -a "$root" "$scratch/root"
	root=$scratch/root
fi
# As postinst does it (systemd-sysusers --root="$DPKG_ROOT" robota-mcpd.conf).
systemd-sysusers --root="$root" robota-mcpd.conf >/dev/null 2>&1 ||
	fail "systemd-sysusers rejected robota-mcpd.conf"
field() { awk -F: -v n="$2" '$1 == "robota-mcpd" { print $n }' "$root/etc/$1" 2>/dev/null || true; }
uid=$(field passwd 3)
gid=$(field group 3)
shell=$(field passwd 7)
if [[ -z $uid || -z $gid ]]; then
	fail "systemd-sysusers did not create the robota-mcpd user and group"
else
	echo "   user robota-mcpd uid $uid, group gid $gid, shell $shell"
	((uid < 1000)) || fail "robota-mcpd is not a system user (uid $uid)"
	[[ $shell == */nologin ]] || fail "robota-mcpd has a login shell ($shell)"
	systemd-tmpfiles --root="$root" --create robota-mcpd.conf ||
		fail "systemd-tmpfiles rejected robota-mcpd.conf"
	state=$root/var/lib/robota-mcpd
	if [[ -d $state ]]; then
		got=$(stat -c '%a %u %g' "$state")
		echo "   /var/lib/robota-mcpd: mode, uid, gid = $got"
		[[ $got == "700 $uid $gid" ]] || fail "state directory is $got, want 700 $uid $gid"
	else
		fail "systemd-tmpfiles did not create /var/lib/robota-mcpd"
	fi
fi

if ((failures)); then
	echo "check-unit: $failures failure(s)" >&2
	exit 1
fi
echo "check-unit: OK (exposure $exposure)"
