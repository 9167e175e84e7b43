#!/usr/bin/env bash
# Build the Debian package: the release binaries (those the test suite runs), man pages
# and completions generated from the clap definitions, then cargo-deb with the metadata in
# daemon/Cargo.toml.
#
#   packaging/build-deb.sh            prints the path of the .deb on its last line
#
# Needs cargo-deb (`cargo install cargo-deb --locked`), dpkg-dev (dpkg-shlibdeps for the
# $auto dependencies) and gzip; tests/setup.sh installs them when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir=${CARGO_TARGET_DIR:-target}

# The release build of the whole workspace's tests and the three binaries used here: the
# same build (the same features of every dependency) as `cargo test --workspace
# --release`, so the package holds the very binaries the tests ran, and after tests/run
# this compiles only robota-docgen.
echo "== release build" >&2
cargo build --release --locked --workspace --tests \
	--bin robota-mcpd --bin robota-mcpctl --bin robota-docgen

echo "== man pages and completions (robota-docgen)" >&2
generated="$target_dir/release/docgen"
rm -rf "$generated"
"$target_dir/release/robota-docgen" "$generated"
# Debian policy: man pages gzipped with -9, no name or timestamp (-n) for reproducibility.
gzip -9n "$generated"/man/man*/*

echo "== cargo deb" >&2
# --no-build: the binaries above are the ones packaged; cargo-deb strips them.
deb=$(cargo deb --locked --no-build -p robota-mcpd --output "$target_dir/debian/" | tail -n 1)
[[ -f $deb ]] || {
	echo "build-deb: cargo deb did not report a package file (got: $deb)" >&2
	exit 1
}
echo "$deb"
