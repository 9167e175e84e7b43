#!/usr/bin/env bash
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
# parse and do what they should; then check-unit.sh on the unpacked tree (unit verified
# against the packaged binary and man pages, sysusers/tmpfiles applied to a copy).
set -euo pipefail
cd "$(dirname "$0")/.."

deb=${1:?usage: packaging/check-deb.sh PATH.deb}
[[ -f $deb ]] || { echo "check-deb: no such file $deb" >&2 && exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
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
	-*) [[ $path == ./usr/bin/* || $perms == -rw-r--r-- ]] || fail "$path is $perms" ;;
	*) fail "$path is neither a file nor a directory ($perms)" ;;
	esac
	case $path in
	./ | ./usr/ | ./usr/bin/* | ./usr/lib/ | ./usr/lib/systemd/ | ./usr/lib/systemd/system/* | \
		./usr/lib/sysusers.d/* | ./usr/lib/tmpfiles.d/* | ./usr/share/ | ./usr/share/man/* | \
		./usr/share/doc/ | ./usr/share/doc/robota-mcpd/* | ./usr/share/bash-completion/* | \
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
contains postinst 'systemd-tmpfiles --create robota-mcpd.conf' "create the state directory"
contains postinst 'deb-systemd-helper enable robota-mcpd.service' "enable the unit"
contains postinst '/usr/bin/robota-mcpd check-config' "check the configuration before starting"
contains postinst 'deb-systemd-invoke "$action" robota-mcpd.service' "start or restart the unit"
contains prerm 'deb-systemd-invoke stop robota-mcpd.service' "stop the unit on remove"
contains postrm 'deb-systemd-helper purge robota-mcpd.service' "forget the unit on purge"
contains postrm 'rm -rf /var/lib/robota-mcpd' "remove the state on purge"
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

echo "-- the unit, from the package"
status=0
report=$(packaging/check-unit.sh --binary "$mcpd" --man-dir "$man" --root "$tree" \
	"$tree/usr/lib/systemd/system/robota-mcpd.service" 2>&1) || status=$?
sed 's/^/   /' <<<"$report"
((status == 0)) || fail "check-unit.sh on the packaged unit"

if ((failures)); then
	echo "check-deb: $failures failure(s) in $deb" >&2
	exit 1
fi
echo "check-deb: OK: $deb"
