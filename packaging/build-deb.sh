#!/usr/bin/env bash
# Build the Debian package: the shipped binaries (the `dist` build, those tests/run's
# end-to-end tests run), man pages and completions generated from the clap definitions,
# then cargo-deb with the metadata in daemon/Cargo.toml.
#
#   packaging/build-deb.sh            prints the path of the .deb on its last line
#
# Needs cargo-deb (`cargo install cargo-deb --locked`), dpkg-dev (dpkg-shlibdeps for the
# $auto dependencies) and gzip; tests/setup.sh installs them when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir=${CARGO_TARGET_DIR:-target}

# The shipped binaries, as tests/run builds them (after it, nothing to do), and the
# generator of their man pages, a tool of the test build (after tests/run, nothing either).
echo "== dist build" >&2
cargo build --profile dist --locked -p robota-mcpd -p robota-mcpctl
cargo build --release --locked -p robota-docgen

echo "== man pages and completions (robota-docgen)" >&2
# Beside the binaries: cargo-deb reads the assets' target/release/ as the profile's
# directory (daemon/Cargo.toml).
generated="$target_dir/dist/docgen"
rm -rf "$generated"
"$target_dir/release/robota-docgen" "$generated"
# Debian policy: man pages gzipped with -9, no name or timestamp (-n) for reproducibility.
gzip -9n "$generated"/man/man*/*

echo "== cargo deb" >&2
# --no-build: the binaries above are the ones packaged; cargo-deb strips them.
deb=$(cargo deb --locked --no-build --profile dist -p robota-mcpd --output "$target_dir/debian/" | tail -n 1)
[[ -f $deb ]] || {
	echo "build-deb: cargo deb did not report a package file (got: $deb)" >&2
	exit 1
}
echo "$deb"
