#!/usr/bin/env bash
# What the tests need beyond the Rust toolchain, installed when it is missing: the one
# definition, used by tests/run before the suite and by the test harness on first use
# (`robota_e2e::setup`), so a narrow `cargo test` sets up what it touches.
#
#   tests/setup.sh [PART...]      (no PART: all of them)
#
# Parts, each idempotent, bounded in time, and naming the registry it needs when that
# registry cannot be reached:
#   debian     Debian packages the tests and the packaging scripts call (Debian's registry):
#              nodejs/npm when node or npm is absent, prometheus (promtool, the server),
#              systemd-container and debootstrap, curl, jq, dbus, dpkg-dev, binutils,
#              groff-base, man-db, systemd; for the fleet test nginx (the gateway),
#              systemd-journal-remote (the log collector) and graphviz (docs/fleet.svg);
#              the user nobody (uid 65534)
#   oidc       the authorization server's node_modules (tests/oidc, npm registry, pinned
#              by its lock file)
#   npm        MCP servers from npm the tests run behind the daemon (tests/npm-mcp,
#              npm registry, pinned by its lock file)
#   py         the Python MCP SDK in a venv at target/py-mcp (PyPI, pinned)
#   cargo-deb  cargo-deb, built from crates.io
#   image      a Debian 12 root with systemd, made once with debootstrap and kept under
#              target/systemd-image/ (Debian's registry); tests boot copies of it
#
# Needs root for `debian` and `image` (CI and tests/run run as root). Parallel callers
# wait for each other on a lock under target/.
set -euo pipefail
cd "$(dirname "$0")/.."

target=${CARGO_TARGET_DIR:-target}
mkdir -p "$target"
target=$(realpath "$target")

# The pins. MCP_VERSION is also robota_e2e::upstream::MCP_VERSION.
MCP_VERSION=2.3.0
CARGO_DEB_VERSION='^3.8'
# Debian 12 with systemd as PID 1, and what the tests run inside it. A change here is a
# new image (the directory name carries a digest of these lines).
IMAGE_SUITE=bookworm
IMAGE_PACKAGES=systemd,systemd-sysv,dbus,ca-certificates,curl,jq,procps,python3,python3-venv,iproute2,prometheus,polkitd,libpam-systemd,systemd-journal-remote

say() { echo "setup: $*" >&2; }
die() {
	say "$*"
	exit 1
}

# bounded SECONDS WHAT COMMAND...: COMMAND, killed after SECONDS; its output is shown
# only when it fails.
bounded() {
	local limit=$1 what=$2 out status=0
	shift 2
	out=$(timeout --kill-after=10 "$limit" "$@" 2>&1) || status=$?
	if ((status == 124 || status == 137)); then
		printf '%s\n' "$out" | tail -n 20 >&2
		die "$what took more than $limit s (is the registry reachable from here?)"
	elif ((status)); then
		printf '%s\n' "$out" | tail -n 20 >&2
		die "$what failed (exit $status)"
	fi
}

need_root() {
	[[ $(id -u) == 0 ]] || die "$1 needs root (run the tests as root, as CI does)"
}

# The apt index is refreshed at most once per run of this script.
apt_updated=
apt_install() {
	need_root "installing Debian packages ($*)"
	if [[ -z $apt_updated ]]; then
		say "apt-get update (Debian's package registry)"
		bounded 300 "apt-get update from Debian's package registry" \
			env DEBIAN_FRONTEND=noninteractive apt-get update -qq
		apt_updated=1
	fi
	say "installing $* from Debian's package registry"
	bounded 600 "apt-get install $* from Debian's package registry" \
		env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		-o DPkg::Lock::Timeout=120 "$@"
}

part_debian() {
	local -a missing=()
	local status=0
	command -v node >/dev/null || missing+=(nodejs)
	command -v npm >/dev/null || missing+=(npm)
	local tool
	for tool in promtool:prometheus prometheus:prometheus systemd-nspawn:systemd-container \
		debootstrap:debootstrap curl:curl jq:jq dbus-daemon:dbus dpkg-shlibdeps:dpkg-dev \
		readelf:binutils strip:binutils groff:groff-base man:man-db \
		systemd-analyze:systemd setpriv:util-linux nsenter:util-linux ip:iproute2 \
		nginx:nginx /lib/systemd/systemd-journal-remote:systemd-journal-remote \
		dot:graphviz; do
		command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
	done
	if ((${#missing[@]})); then
		# Packaged services (nginx on port 80) are not started by the install: the tests
		# run their own instances in network namespaces of their own.
		local policy=
		if [[ ! -e /usr/sbin/policy-rc.d ]]; then
			need_root "installing Debian packages"
			printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
			chmod 0755 /usr/sbin/policy-rc.d
			policy=1
		fi
		# shellcheck disable=SC2046 # one word per package
		(apt_install $(printf '%s\n' "${missing[@]}" | sort -u)) || status=$?
		[[ -z $policy ]] || rm -f /usr/sbin/policy-rc.d
		((status == 0)) || exit "$status"
	fi
	# Some end-to-end tests drop a child to uid 65534.
	if ! getent passwd 65534 >/dev/null; then
		need_root "creating the user nobody (uid 65534)"
		useradd --system --uid 65534 --no-create-home --shell /usr/sbin/nologin nobody
	fi
}

part_oidc() {
	[[ -f tests/oidc/node_modules/oidc-provider/package.json ]] && return
	command -v npm >/dev/null || part_debian
	say "npm ci --prefix tests/oidc (the npm registry)"
	bounded 300 "npm ci --prefix tests/oidc from the npm registry" \
		npm ci --prefix tests/oidc --no-audit --no-fund --ignore-scripts
}

part_npm() {
	[[ -f tests/npm-mcp/node_modules/@modelcontextprotocol/server-filesystem/package.json ]] && return
	command -v npm >/dev/null || part_debian
	say "npm ci --prefix tests/npm-mcp (the npm registry)"
	bounded 300 "npm ci --prefix tests/npm-mcp from the npm registry" \
		npm ci --prefix tests/npm-mcp --no-audit --no-fund --ignore-scripts
}

part_py() {
	local venv=$target/py-mcp
	if "$venv/bin/python" -c "import importlib.metadata as m, sys, mcp.server.mcpserver; sys.exit(m.version('mcp') != '$MCP_VERSION')" 2>/dev/null; then
		return
	fi
	say "python3 -m venv $venv; pip install mcp==$MCP_VERSION (PyPI)"
	# Built beside its place and renamed in: nobody ever sees half a venv.
	rm -rf "$venv.new" "$venv"
	bounded 120 "python3 -m venv (needs python3 with its venv module)" python3 -m venv "$venv.new"
	bounded 300 "pip install mcp==$MCP_VERSION from PyPI" \
		"$venv.new/bin/pip" install --quiet --disable-pip-version-check "mcp==$MCP_VERSION"
	mv "$venv.new" "$venv"
}

part_cargo_deb() {
	cargo deb --version >/dev/null 2>&1 && return
	say "cargo install cargo-deb (crates.io)"
	bounded 900 "cargo install cargo-deb from crates.io" \
		cargo install cargo-deb --locked --version "$CARGO_DEB_VERSION"
}

# The image's directory, named by a digest of its recipe.
image_dir() {
	local digest
	digest=$(printf '%s\n' "$IMAGE_SUITE" "$IMAGE_PACKAGES" "$(sed -n '/^part_image()/,/^}/p' "$0")" |
		sha256sum | cut -c1-12)
	echo "$target/systemd-image/$IMAGE_SUITE-$digest"
}

part_image() {
	local dir
	dir=$(image_dir)
	[[ -f $dir/ready ]] && return
	need_root "making the Debian image (debootstrap)"
	command -v debootstrap >/dev/null && command -v systemd-nspawn >/dev/null || part_debian
	# Older images go: each is a few hundred MB.
	rm -rf "$target/systemd-image"
	mkdir -p "$dir"
	say "debootstrap $IMAGE_SUITE into $dir (Debian's package registry)"
	local mirror
	# This machine's own Debian mirror, else Debian's.
	mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
		sed -n 's/^URIs: *//p; s/^deb \(\[[^]]*\] \)\?\(http[^ ]*\) .*/\2/p' |
		grep -v security | head -n 1 || true)
	bounded 600 "debootstrap from Debian's package registry (${mirror:-http://deb.debian.org/debian})" \
		debootstrap --variant=minbase --include="$IMAGE_PACKAGES" "$IMAGE_SUITE" "$dir/root" \
		"${mirror:-http://deb.debian.org/debian}"
	local root=$dir/root
	# A container, not a machine: no getty on its console, no network set-up of its own, an
	# identity of its own per boot (machine-id made empty, so systemd makes one).
	rm -f "$root/etc/machine-id" && : >"$root/etc/machine-id"
	ln -sf /dev/null "$root/etc/systemd/system/console-getty.service"
	ln -sf /dev/null "$root/etc/systemd/system/getty@.service"
	# pip and npm inside reach the registries through the host's CA bundle.
	install -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
	# The journal kept in memory: a test reads it while the container runs.
	mkdir -p "$root/etc/systemd/journald.conf.d"
	printf '[Journal]\nStorage=volatile\nRateLimitBurst=0\n' >"$root/etc/systemd/journald.conf.d/test.conf"
	# Debian's prometheus is there for a test to start; it does not start at boot.
	rm -f "$root/etc/systemd/system/multi-user.target.wants/prometheus.service"
	# polkitd's own package kept, so that a test can remove it (a minimal Debian has none)
	# and install it again with no network.
	mkdir -p "$root/root/debs"
	cp "$root"/var/cache/apt/archives/polkitd_*.deb "$root/root/debs/" 2>/dev/null ||
		(cd "$root/root/debs" && bounded 120 "apt-get download polkitd (Debian's package registry)" apt-get download polkitd)
	apt-get -o RootDir="$root" clean >/dev/null 2>&1 || rm -rf "$root/var/cache/apt/archives/"*.deb
	touch "$dir/ready"
}

# All parts by default. One lock per part: parallel callers of one part wait for each
# other, and the image can be made while the rest is set up.
parts=("$@")
((${#parts[@]})) || parts=(debian oidc npm py cargo-deb image)
for part in "${parts[@]}"; do
	exec 9>"$target/.setup-$part.lock"
	flock 9
	case $part in
	debian) part_debian ;;
	oidc) part_oidc ;;
	npm) part_npm ;;
	py) part_py ;;
	cargo-deb) part_cargo_deb ;;
	image) part_image ;;
	image-dir) image_dir ;;
	*) die "unknown part '$part' (debian, oidc, npm, py, cargo-deb, image, image-dir)" ;;
	esac
	exec 9>&-
done
