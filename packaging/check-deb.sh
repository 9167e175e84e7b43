#!/usr/bin/env bash
# shellcheck disable=SC2016 # the single-quoted $… are script text matched literally
# Check a built robota-mcpd .deb by unpacking it (dpkg-deb -I/-c/-e/-x); nothing is installed.
#
#   packaging/check-deb.sh PATH.deb
#
# Asserts: the control fields and dependencies; every expected file present, owned by
# root, with its mode (binaries 0755, everything else 0644) and nothing outside the
# expected directories; the conffile listed in conffiles and byte-identical to
# daemon/src/default-config.toml (and to what the packaged binary embeds, and accepted by
# its check-config); the unit, sysusers.d and tmpfiles.d files identical to systemd/; a
# gzipped, groff-clean man page for each command and subcommand the packaged binaries
# list; bash/zsh/fish completions for both binaries; the docs; maintainer scripts that
# parse and do what they should, and run for real in scratch roots ($DPKG_ROOT) with and
# without a (fake) running systemd and with and without systemd-sysusers/-tmpfiles: the
# user, the state directory's owner and mode, root-owned left-overs given back, prerm
# stopping the packaged daemon started by hand; then check-unit.sh on the unpacked tree
# (unit verified against the packaged binary and man pages, sysusers/tmpfiles applied to
# a copy).
set -euo pipefail
cd "$(dirname "$0")/.."

deb=${1:?usage: packaging/check-deb.sh PATH.deb}
[[ -f $deb ]] || { echo "check-deb: no such file $deb" >&2 && exit 1; }
scratch=$(mktemp -d)
# Daemons the script scenarios start, killed on the way out if a check left one running.
started=()
cleanup() {
	local pid
	for pid in "${started[@]}"; do
		# Only while it is still ours: the pid of one that exited may be someone else's now.
		if [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$scratch"/* ]]; then
			kill -KILL "$pid" 2>/dev/null || true
		fi
	done
	rm -rf "$scratch"
}
trap cleanup EXIT
# The daemon started as its own user must reach its configuration and binary.
chmod 0755 "$scratch"
tree=$scratch/tree
control=$scratch/DEBIAN
dpkg-deb -x "$deb" "$tree"
dpkg-deb -e "$deb" "$control"

failures=0
fail() {
	echo "check-deb: FAIL: $*" >&2
	failures=$((failures + 1))
}

echo "-- control"
field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Package) == robota-mcpd ]] || fail "Package is $(field Package)"
[[ $(field Version) == "$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"-* ]] ||
	fail "Version $(field Version) is not the workspace version"
# The tool families of the catalog, as an operator choosing the package reads them.
description=$(field Description)
for family in 'system.*' 'file.*' 'job.*' 'service.*' 'docker.*' 'permissions.*' 'turn-submission tool'; do
	[[ $description == *"$family"* ]] || fail "the package description does not name $family"
done
depends=$(field Depends)
echo "   Depends: $depends"
for needed in 'libc6' 'systemd | systemd-sysusers | systemd-standalone-sysusers' 'init-system-helpers'; do
	[[ $depends == *"$needed"* ]] || fail "Depends lacks $needed"
done

echo "-- files, owners and modes"
# dpkg-deb -c: perms owner/group size date time path
listing=$(dpkg-deb -c "$deb")
mode_of() { awk -v p="./$1" '$6 == p { print $1 }' <<<"$listing"; }
expect() { # expect MODE PATH
	local got
	got=$(mode_of "$2")
	if [[ -z $got ]]; then
		fail "missing /$2"
	elif [[ $got != "$1" ]]; then
		fail "/$2 is $got, want $1"
	fi
}
expect -rwxr-xr-x usr/bin/robota-mcpd
expect -rwxr-xr-x usr/bin/robota-mcpctl
expect -rw-r--r-- etc/robota-mcpd/config.toml
expect -rw-r--r-- usr/lib/systemd/system/robota-mcpd.service
expect -rw-r--r-- usr/lib/sysusers.d/robota-mcpd.conf
expect -rw-r--r-- usr/lib/tmpfiles.d/robota-mcpd.conf
expect -rw-r--r-- usr/share/doc/robota-mcpd/copyright
expect -rw-r--r-- usr/share/doc/robota-mcpd/README.md
expect -rw-r--r-- usr/share/doc/robota-mcpd/packaging/README.md
expect -rwxr-xr-x usr/share/robota-mcpd/fleet/robota-mcpd-fleet
expect -rw-r--r-- usr/share/robota-mcpd/fleet/hosts.example
for doc in docs/*.md; do
	expect -rw-r--r-- "usr/share/doc/robota-mcpd/$doc"
done
for bin in robota-mcpd robota-mcpctl; do
	expect -rw-r--r-- "usr/share/bash-completion/completions/$bin"
	expect -rw-r--r-- "usr/share/zsh/vendor-completions/_$bin"
	expect -rw-r--r-- "usr/share/fish/vendor_completions.d/$bin.fish"
done
# Only root-owned entries, files 0644 unless in usr/bin, directories 0755, and nothing
# outside the directories the package is meant to own.
while read -r perms owner _ _ _ path _; do
	[[ $owner == root/root || $owner == 0/0 ]] || fail "$path is owned by $owner"
	case $perms in
	d*) [[ $perms == drwxr-xr-x ]] || fail "directory $path is $perms" ;;
	-*) [[ $path == ./usr/bin/* || $path == ./usr/share/robota-mcpd/fleet/robota-mcpd-fleet ||
		$perms == -rw-r--r-- ]] || fail "$path is $perms" ;;
	*) fail "$path is neither a file nor a directory ($perms)" ;;
	esac
	case $path in
	./ | ./usr/ | ./usr/bin/* | ./usr/lib/ | ./usr/lib/systemd/ | ./usr/lib/systemd/system/* | \
		./usr/lib/sysusers.d/* | ./usr/lib/tmpfiles.d/* | ./usr/share/ | ./usr/share/man/* | \
		./usr/share/doc/ | ./usr/share/doc/robota-mcpd/* | ./usr/share/robota-mcpd/* | ./usr/share/bash-completion/* | \
		./usr/share/zsh/* | ./usr/share/fish/* | ./etc/ | ./etc/robota-mcpd/*) ;;
	*) fail "unexpected path $path" ;;
	esac
done <<<"$listing"

echo "-- conffiles and the configuration"
conffiles=$(cat "$control/conffiles" 2>/dev/null || true)
[[ $conffiles == /etc/robota-mcpd/config.toml ]] ||
	fail "conffiles is '$conffiles', want exactly /etc/robota-mcpd/config.toml"
cmp -s "$tree/etc/robota-mcpd/config.toml" daemon/src/default-config.toml ||
	fail "/etc/robota-mcpd/config.toml differs from daemon/src/default-config.toml"
mcpd=$tree/usr/bin/robota-mcpd
mcpctl=$tree/usr/bin/robota-mcpctl
"$mcpd" default-config | cmp -s - "$tree/etc/robota-mcpd/config.toml" ||
	fail "the packaged binary embeds a different default configuration"
"$mcpd" check-config --config "$tree/etc/robota-mcpd/config.toml" 2>/dev/null ||
	fail "the packaged binary rejects the packaged configuration"

echo "-- the fleet generator (docs/fleet.md)"
fleet=$tree/usr/share/robota-mcpd/fleet
"$fleet/robota-mcpd-fleet" targets --hosts "$fleet/hosts.example" >"$scratch/targets.yml" &&
	grep -q 'instance: "mcp-b"' "$scratch/targets.yml" ||
	fail "the fleet generator makes no Prometheus target per host of hosts.example"
"$fleet/robota-mcpd-fleet" nginx --hosts "$fleet/hosts.example" --gateway gw.example.com \
	--cert /c.pem --key /k.pem >"$scratch/fleet.conf" &&
	grep -q 'location = /hosts/mcp-c/mcp' "$scratch/fleet.conf" ||
	fail "the fleet generator makes no gateway route per host of hosts.example"
"$fleet/robota-mcpd-fleet" host --hosts "$fleet/hosts.example" --gateway gw.example.com \
	--name mcp-a --proxy 10.77.0.1 --issuer https://auth.example.com \
	--config "$tree/etc/robota-mcpd/config.toml" >"$scratch/host.toml" &&
	printf 'scopes = ["mcp"]\nallowed_clients = ["ops-agent"]\n' >>"$scratch/host.toml" &&
	"$tree/usr/bin/robota-mcpd" check-config --config "$scratch/host.toml" 2>/dev/null ||
	fail "the fleet generator's host configuration (for mcp-a of hosts.example) fails check-config"
if "$fleet/robota-mcpd-fleet" nginx --hosts /dev/null --gateway g --cert c --key k 2>"$scratch/err"; then
	fail "the fleet generator accepts an empty host list"
fi
grep -q 'names no host' "$scratch/err" || fail "the fleet generator does not say why it refuses: $(cat "$scratch/err")"
# A value that would add a directive is refused, and --output leaves the file as it was.
cp "$scratch/targets.yml" "$scratch/kept.yml"
printf 'mcp_b 10.1.1.1\n' >"$scratch/bad-hosts"
if "$fleet/robota-mcpd-fleet" targets --hosts "$scratch/bad-hosts" --output "$scratch/kept.yml" 2>/dev/null; then
	fail "the fleet generator accepts a host name that is not a DNS label"
fi
cmp -s "$scratch/targets.yml" "$scratch/kept.yml" || fail "a refused --output run changed the file"
if "$fleet/robota-mcpd-fleet" nginx --hosts "$fleet/hosts.example" --gateway g --key k \
	--cert '/c; include /etc/shadow; #' >/dev/null 2>&1; then
	fail "the fleet generator writes a certificate path that adds nginx directives"
fi

echo "-- binaries"
for bin in "$mcpd" "$mcpctl"; do
	version=$("$bin" --version || true)
	[[ $version == "$(basename "$bin") $(field Version | cut -d- -f1)" ]] ||
		fail "$(basename "$bin") --version says '$version'"
	readelf -S "$bin" | grep -q '\.symtab' && fail "$(basename "$bin") is not stripped"
done

echo "-- systemd files are the repository's"
cmp -s "$tree/usr/lib/systemd/system/robota-mcpd.service" systemd/robota-mcpd.service ||
	fail "packaged unit differs from systemd/robota-mcpd.service"
cmp -s "$tree/usr/lib/sysusers.d/robota-mcpd.conf" systemd/robota-mcpd.sysusers ||
	fail "packaged sysusers.d file differs from systemd/robota-mcpd.sysusers"
cmp -s "$tree/usr/lib/tmpfiles.d/robota-mcpd.conf" systemd/robota-mcpd.tmpfile ||
	fail "packaged tmpfiles.d file differs from systemd/robota-mcpd.tmpfile"

echo "-- man pages"
man=$tree/usr/share/man
# The commands each packaged binary lists in its --help, with one level of nesting.
commands_of() { "$@" --help | awk '/^Commands:/ { on = 1; next } on && /^$/ { exit } on { print $1 }' | grep -vx help || true; }
pages=(man8/robota-mcpd.8.gz man1/robota-mcpctl.1.gz)
for sub in $(commands_of "$mcpd"); do
	pages+=("man8/robota-mcpd-$sub.8.gz")
done
for sub in $(commands_of "$mcpctl"); do
	pages+=("man1/robota-mcpctl-$sub.1.gz")
	for leaf in $(commands_of "$mcpctl" "$sub"); do
		pages+=("man1/robota-mcpctl-$sub-$leaf.1.gz")
	done
done
((${#pages[@]} >= 10)) || fail "only ${#pages[@]} commands found in --help; parsing broke?"
for page in "${pages[@]}"; do
	expect -rw-r--r-- "usr/share/man/$page"
done
found=0
for page in "$man"/man*/*; do
	found=$((found + 1))
	name=$(basename "$page")
	[[ $name == *.gz ]] || { fail "man page $name is not gzipped" && continue; }
	gzip -t "$page" 2>/dev/null || { fail "man page $name is not valid gzip" && continue; }
	title=$(zcat "$page" | sed -n 's/^\.TH \([^ ]*\) \([0-9]\).*/\1.\2/p')
	[[ "$title.gz" == "$name" ]] || fail "man page $name has title '$title'"
	warnings=$(zcat "$page" | groff -man -Tutf8 -ww -z 2>&1 || true)
	[[ -z $warnings ]] || fail "groff warns about $name: $warnings"
done
echo "   ${#pages[@]} commands, $found pages"
((found == ${#pages[@]})) || fail "$found man pages for ${#pages[@]} commands"

echo "-- completions"
for bin in robota-mcpd robota-mcpctl; do
	bash -n "$tree/usr/share/bash-completion/completions/$bin" || fail "bash completion for $bin does not parse"
	if command -v zsh >/dev/null; then
		zsh -n "$tree/usr/share/zsh/vendor-completions/_$bin" || fail "zsh completion for $bin does not parse"
	fi
	if command -v fish >/dev/null; then
		fish -n "$tree/usr/share/fish/vendor_completions.d/$bin.fish" || fail "fish completion for $bin does not parse"
	fi
done
for sub in $(commands_of "$mcpctl"); do
	grep -qw -- "$sub" "$tree/usr/share/bash-completion/completions/robota-mcpctl" ||
		fail "bash completion does not know robota-mcpctl $sub"
done

echo "-- maintainer scripts"
for script in postinst prerm postrm; do
	[[ -x $control/$script ]] || { fail "no executable $script" && continue; }
	sh -n "$control/$script" || fail "$script does not parse"
	grep -q '#DEBHELPER#' "$control/$script" && fail "$script still holds the #DEBHELPER# token"
done
contains() { # contains SCRIPT TEXT WHY
	grep -qF -- "$2" "$control/$1" || fail "$1 does not $3 ($2)"
}
contains postinst 'systemd-sysusers ${DPKG_ROOT:+--root="$DPKG_ROOT"} robota-mcpd.conf' "create the system user"
contains postinst 'systemd-tmpfiles ${DPKG_ROOT:+--root="$DPKG_ROOT"} --create robota-mcpd.conf' "create the state directory"
contains postinst 'install -d -o "$uid" -g "$gid" -m 0700' "create the state directory without systemd-tmpfiles"
contains postinst 'useradd ${root:+--prefix "$root"} --system' "create the user without systemd-sysusers"
contains postinst 'deb-systemd-helper enable robota-mcpd.service' "enable the unit"
contains postinst '/usr/bin/robota-mcpd check-config' "check the configuration before starting"
contains postinst 'deb-systemd-invoke "$action" robota-mcpd.service' "start or restart the unit"
contains prerm 'deb-systemd-invoke stop robota-mcpd.service' "stop the unit on remove"
contains postrm 'deb-systemd-helper purge robota-mcpd.service' "forget the unit on purge"
contains postrm 'rm -rf "${DPKG_ROOT:-}/var/lib/robota-mcpd"' "remove the state on purge"
# Only our postinst starts the daemon, and only after check-config: no debhelper start.
grep -q -e '_dh_action' -e 'deb-systemd-invoke start' -e 'deb-systemd-invoke restart' "$control/postinst" &&
	fail "postinst starts the unit without checking the configuration"
# sysusers before tmpfiles (the directory's owner must exist), both before the start.
first_line() { grep -n -- "$1" "$control/postinst" | grep -v '^[0-9]*:[[:space:]]*#' | head -n 1 | cut -d: -f1 || true; }
sysusers=$(first_line systemd-sysusers)
tmpfiles=$(first_line systemd-tmpfiles)
check=$(first_line check-config)
((${sysusers:-0} > 0 && ${sysusers:-0} < ${tmpfiles:-0} && ${tmpfiles:-0} < ${check:-0})) ||
	fail "postinst does not run sysusers, then tmpfiles, then check-config (lines ${sysusers:-?} ${tmpfiles:-?} ${check:-?})"

echo "-- maintainer scripts, run in scratch roots"
# Each scenario gets a copy of the unpacked tree as $DPKG_ROOT, with a minimal user
# database, and no systemd running (the scripts test $DPKG_ROOT/run/systemd/system): a
# container or chroot without systemd as PID 1. deb-systemd-helper and
# deb-systemd-invoke and systemctl are stubs that log their arguments (the real ones would
# act on this machine's systemd). A second PATH lacks systemd-sysusers and systemd-tmpfiles, for the
# useradd and install -d fallbacks. With systemd as PID 1 the scripts run for real in
# tests/tests/system/.
stubs=$scratch/stubs
bare=$scratch/bare
mkdir -p "$stubs" "$bare" "$scratch/roots"
for tool in deb-systemd-helper deb-systemd-invoke systemctl; do
	printf '#!/bin/sh\necho "%s $*" >>"$CHECK_DEB_CALLS"\n' "$tool" >"$stubs/$tool"
	chmod 0755 "$stubs/$tool"
done
IFS=: read -ra path_dirs <<<"$PATH"
for dir in "${path_dirs[@]}"; do
	for exe in "$dir"/*; do
		name=${exe##*/}
		[[ -f $exe && -x $exe && ! -e $bare/$name ]] || continue
		[[ $name == systemd-sysusers || $name == systemd-tmpfiles ]] || ln -s "$exe" "$bare/$name"
	done
done
with_tools=$stubs:$PATH
without_tools=$stubs:$bare
# For the daemon the scenarios start: the packaged configuration's defaults, on ports no
# other test holds; the directories come from the environment, as the unit passes them.
printf '[loopback]\nlisten = "127.0.0.1:0"\n\n[metrics]\nlisten = "127.0.0.1:0"\n' >"$scratch/run.toml"
chmod 0644 "$scratch/run.toml"
host_state_before=$([[ -e /var/lib/robota-mcpd ]] && echo yes || echo no)
host_user_before=$(getent passwd robota-mcpd >/dev/null && echo yes || echo no)

new_root() { # new_root NAME: a fresh root, its path printed
	local r=$scratch/roots/$1
	mkdir -p "$r"
	cp -a "$tree/." "$r/"
	mkdir -p "$r/etc"
	echo 'root:x:0:0:root:/root:/bin/sh' >"$r/etc/passwd"
	echo 'root:x:0:' >"$r/etc/group"
	echo 'root:*:19000:0:99999:7:::' >"$r/etc/shadow"
	echo 'root:*::' >"$r/etc/gshadow"
	chmod 0640 "$r/etc/shadow" "$r/etc/gshadow"
	echo "$r"
}
# maint ROOT PATH SCRIPT ARGS…: run a maintainer script as dpkg would, bounded in time
# (prerm waits at most 30 s for a daemon); its stderr is shown and kept in $scratch/err,
# the stubs' calls in $scratch/calls. $wrap, when set, runs before the script.
wrap=()
maint() {
	local r=$1 path=$2 script=$3 status=0
	shift 3
	: >"$scratch/calls"
	"${wrap[@]}" timeout 60 env DPKG_ROOT="$r" DPKG_MAINTSCRIPT_PACKAGE=robota-mcpd \
		DPKG_MAINTSCRIPT_NAME="$script" CHECK_DEB_CALLS="$scratch/calls" PATH="$path" \
		sh "$control/$script" "$@" 2>"$scratch/err" || status=$?
	echo "   ${r##*/}: $script $*"
	sed 's/^/      | /' "$scratch/err"
	((status == 0)) || fail "$script $* exited $status in ${r##*/}"
}
called() { grep -qxF -- "$1" "$scratch/calls" || fail "no call: $1 (calls: $(paste -sd';' "$scratch/calls"))"; }
said() { grep -qF -- "$1" "$scratch/err" || fail "the script did not say: $1"; }
# account ROOT: the user, the group, the state directory; sets uid and gid.
account() {
	local r=$1 entry count dir
	entry=$(awk -F: '$1 == "robota-mcpd"' "$r/etc/passwd")
	count=$(grep -c '^robota-mcpd:' "$r/etc/passwd" || true)
	uid=$(cut -d: -f3 <<<"$entry")
	gid=$(awk -F: '$1 == "robota-mcpd" { print $3 }' "$r/etc/group")
	if [[ -z $uid || -z $gid ]]; then
		fail "no robota-mcpd user and group in ${r##*/}"
		uid=0 gid=0
		return
	fi
	((count == 1)) || fail "$count robota-mcpd users in ${r##*/}"
	((uid < 1000)) || fail "robota-mcpd is not a system user (uid $uid) in ${r##*/}"
	[[ $(cut -d: -f4 <<<"$entry") == "$gid" ]] || fail "robota-mcpd's primary group is not robota-mcpd: $entry"
	[[ $(cut -d: -f6 <<<"$entry") == /var/lib/robota-mcpd ]] || fail "robota-mcpd's home: $entry"
	[[ $(cut -d: -f7 <<<"$entry") == */nologin ]] || fail "robota-mcpd has a login shell: $entry"
	dir=$(stat -c '%a %u %g' "$r/var/lib/robota-mcpd" 2>/dev/null || echo missing)
	[[ $dir == "700 $uid $gid" ]] || fail "/var/lib/robota-mcpd is '$dir', want '700 $uid $gid' in ${r##*/}"
	[[ -d $r/etc/robota-mcpd ]] || fail "no /etc/robota-mcpd in ${r##*/}"
	echo "      => $entry; /var/lib/robota-mcpd mode, uid, gid: $dir"
}
owned() { # owned PATH UID:GID
	local got
	got=$(stat -c '%u:%g' "$1" 2>/dev/null || echo missing)
	[[ $got == "$2" ]] || fail "${1#"$scratch"/roots/} is owned by $got, want $2"
}
# start_daemon ROOT root|user: the packaged binary from ROOT, as the unit runs it (the
# directories in the environment), as root (a run by hand) or as the root's robota-mcpd
# user; waits until its control socket answers. Sets daemon_pid.
start_daemon() {
	local r=$1 run=$1/run/robota-mcpd i
	local -a as=()
	if [[ $2 == user ]]; then
		# As "Without systemd" in packaging/README.md has it (the run as root made $run
		# its own, and /run's stand-in with the daemon's umask).
		rm -rf "$run"
		install -d -m 0755 "$r/run"
		install -d -o "$uid" -g "$gid" -m 0755 "$run"
		as=(setpriv --reuid="$uid" --regid="$gid" --clear-groups)
	fi
	"${as[@]}" env -i PATH=/usr/bin:/bin STATE_DIRECTORY="$r/var/lib/robota-mcpd" \
		RUNTIME_DIRECTORY="$run" "$r/usr/bin/robota-mcpd" --config "$scratch/run.toml" \
		>"$scratch/daemon.log" 2>&1 &
	daemon_pid=$!
	started+=("$daemon_pid")
	for ((i = 0; i < 200; i++)); do
		if "$r/usr/bin/robota-mcpctl" --socket "$run/control.sock" status >/dev/null 2>&1; then
			echo "   ${r##*/}: the packaged daemon runs as $2, pid $daemon_pid"
			return 0
		fi
		kill -0 "$daemon_pid" 2>/dev/null || break
		sleep 0.1
	done
	fail "the packaged daemon did not start as $2: $(tail -n 3 "$scratch/daemon.log")"
}
running() { [[ -r /proc/$1/stat && $(sed 's/.*) //; s/ .*//' "/proc/$1/stat" 2>/dev/null) != Z ]]; }
# After prerm: the daemon has exited, through its SIGTERM drain.
stopped() {
	local status=0
	if running "$daemon_pid"; then
		fail "prerm remove left the daemon (pid $daemon_pid) running"
		kill -KILL "$daemon_pid" 2>/dev/null || true
	fi
	wait "$daemon_pid" || status=$?
	((status == 0)) || fail "the daemon exited with status $status after prerm"
	grep -q 'SIGTERM' "$scratch/daemon.log" || fail "the daemon did not get a SIGTERM"
	said "stopping robota-mcpd (not run by systemd), pid $daemon_pid"
}
state_files=(audit.jsonl robota.db robota.db-wal)

# With systemd running, the scripts are tested for real: tests/tests/system/ installs,
# upgrades, removes and purges the package in a Debian booted with systemd.
echo "   -- no systemd running, with systemd-sysusers and systemd-tmpfiles"
r=$(new_root plain)
maint "$r" "$with_tools" postinst configure
account "$r"
called 'deb-systemd-helper enable robota-mcpd.service'
grep -q '^deb-systemd-invoke' "$scratch/calls" && fail "postinst started the unit without systemd"
# A run by hand as root (a container's shell), stopped by prerm: its files are root's.
start_daemon "$r" root
maint "$r" "$with_tools" prerm remove
stopped
for file in audit.jsonl robota.db; do
	owned "$r/var/lib/robota-mcpd/$file" 0:0
done
# Configured again, the left-overs are the daemon's, and it starts as its own user.
maint "$r" "$with_tools" postinst configure 0.0.1
for file in audit.jsonl robota.db; do
	owned "$r/var/lib/robota-mcpd/$file" "$uid:$gid"
	said "/var/lib/robota-mcpd/$file was owned by uid:gid 0:0"
done
start_daemon "$r" user
# Without CAP_SYS_PTRACE root cannot read another user's /proc/PID/exe (as in many
# containers): prerm finds the daemon by its control socket's lock.
wrap=(setpriv --bounding-set=-sys_ptrace --inh-caps=-sys_ptrace)
"${wrap[@]}" sh -c "readlink /proc/$daemon_pid/exe" >/dev/null 2>&1 &&
	echo "   (note: /proc/PID/exe readable without CAP_SYS_PTRACE here; the lock is not what found it)"
maint "$r" "$with_tools" prerm remove
wrap=()
stopped
maint "$r" "$with_tools" postrm purge
[[ ! -e $r/var/lib/robota-mcpd && ! -e $r/run/robota-mcpd ]] || fail "postrm purge left the state or runtime directory"

echo "   -- no systemd running, no systemd-sysusers, no systemd-tmpfiles"
r=$(new_root bare)
maint "$r" "$without_tools" postinst configure
account "$r"
said "systemd-sysusers is missing"
maint "$r" "$without_tools" postinst configure 0.0.1
account "$r"
maint "$r" "$without_tools" prerm remove
maint "$r" "$without_tools" postrm purge
[[ ! -e $r/var/lib/robota-mcpd ]] || fail "postrm purge left /var/lib/robota-mcpd"

# $DPKG_ROOT honoured: nothing of this machine's was touched.
[[ $([[ -e /var/lib/robota-mcpd ]] && echo yes || echo no) == "$host_state_before" ]] ||
	fail "the scripts made /var/lib/robota-mcpd on this machine"
[[ $(getent passwd robota-mcpd >/dev/null && echo yes || echo no) == "$host_user_before" ]] ||
	fail "the scripts made a robota-mcpd user on this machine"
if command -v shellcheck >/dev/null; then
	shellcheck -s sh "$control/postinst" "$control/prerm" "$control/postrm" ||
		fail "shellcheck finds fault with the maintainer scripts"
fi

echo "-- the unit, from the package"
status=0
report=$(packaging/check-unit.sh --binary "$mcpd" --man-dir "$man" --root "$tree" \
	"$tree/usr/lib/systemd/system/robota-mcpd.service" 2>&1) || status=$?
# shellcheck disable=SC2001 # a prefix on every line
sed 's/^/   /' <<<"$report"
((status == 0)) || fail "check-unit.sh on the packaged unit"

if ((failures)); then
	echo "check-deb: $failures failure(s) in $deb" >&2
	exit 1
fi
echo "check-deb: OK: $deb"
