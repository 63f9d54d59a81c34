#!/usr/bin/env bash
# Carry a Redis server, its CLI and redis-benchmark, with every shared library they load (glibc
# and its loader included), and the Python client (redis-py + hiredis for the GPU host's Python),
# to a machine with no package index: `kvoffload bench tiers` and `bench e2e --lower-tiers` start
# their own server from PATH.
#
# Runs HERE (Debian, apt and pip reachable). Builds, in the repository root:
#   .carry/redis/bin/{redis-server,redis-cli,redis-benchmark}  wrappers: the carried loader runs
#                                                              the real binary on the carried libs
#   .carry/redis/libexec/   the Debian binaries      .carry/redis/lib/   their libraries
#   .carry/redis/site/      redis-py and hiredis for --python (default 3.12), unpacked wheels
# .carry must be listed in .git/info/exclude of the main repository (it is an ignored path the
# device run carries). On the other machine:
#   export PATH=$PWD/.carry/redis/bin:$PATH PYTHONPATH=$PWD/.carry/redis/site:$PYTHONPATH
# The binaries come from the packages (apt-get download + dpkg -x), never from this machine's
# /usr; the wrappers do not depend on the other machine's glibc.
# Usage: bash benchmarks/carry_redis.sh [--python 3.12]
set -euo pipefail

PY_VERSION=3.12
if [ "${1:-}" = "--python" ]; then PY_VERSION=$2; fi
ROOT=$(git rev-parse --show-toplevel)
OUT=$ROOT/.carry/redis
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "carry_redis.sh: needs redis-server and redis-cli installed here (bash .ci/tiers.sh)," \
        "to list the libraries they load" >&2
    exit 1
fi
BINARIES=(/usr/bin/redis-check-rdb /usr/bin/redis-cli /usr/bin/redis-benchmark)
# Every library the binaries load, and the packages that ship them (and the binaries).
mapfile -t LIBS < <(ldd "${BINARIES[@]}" | awk '/=>/ {print $3} /ld-linux/ {print $1}' \
    | grep '^/' | sort -u)
owner() {  # the package that ships $1 (merged /usr: it may list the file under either path)
    local real cand
    real=$(readlink -f "$1")
    for cand in "$1" "$real" "/usr$1" "/usr$real" "${1#/usr}" "${real#/usr}"; do
        if dpkg -S "$cand" 2>/dev/null | head -n1 | cut -d: -f1; then return 0; fi
    done
    echo "carry_redis.sh: no package ships $1" >&2
    return 1
}
mapfile -t PKGS < <(for f in "${BINARIES[@]}" "${LIBS[@]}"; do owner "$f"; done \
    | tr ',' '\n' | sed 's/ //g' | sort -u)
echo "carry_redis.sh: packages ${PKGS[*]}"
chmod 777 "$WORK"  # apt downloads as its own user where it can
(cd "$WORK" && apt-get download -q "${PKGS[@]}" >/dev/null 2>&1)
mkdir -p "$WORK/root"
for deb in "$WORK"/*.deb; do dpkg -x "$deb" "$WORK/root"; done

rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/libexec" "$OUT/lib" "$OUT/site"
for bin in "${BINARIES[@]}"; do cp "$WORK/root$bin" "$OUT/libexec/"; done
for lib in "${LIBS[@]}"; do
    name=$(basename "$lib")
    found=$(find "$WORK/root" -name "$name" \( -type f -o -type l \) | head -n1)
    if [ -z "$found" ]; then
        echo "carry_redis.sh: $name is in none of the packages" >&2
        exit 1
    fi
    cp -L "$found" "$OUT/lib/$name"
done

wrapper() {  # $1: the name on PATH, $2: the binary in libexec (redis-server is redis-check-rdb
    # run under the name redis-server: it picks its mode from argv[0])
    cat >"$OUT/bin/$1" <<EOF
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/..
exec "\$here/lib/ld-linux-x86-64.so.2" --library-path "\$here/lib" --argv0 "$1" \\
    "\$here/libexec/$2" "\$@"
EOF
    chmod +x "$OUT/bin/$1"
}
wrapper redis-server redis-check-rdb
wrapper redis-cli redis-cli
wrapper redis-benchmark redis-benchmark

# The client, as this checkout uses it, for the other machine's Python.
REDIS_PY=$(python -c 'import redis; print(redis.__version__)')
HIREDIS=$(python -c 'import hiredis; print(hiredis.__version__)')
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    "redis==$REDIS_PY" "hiredis==$HIREDIS" -d "$WORK/wheels"
for whl in "$WORK"/wheels/*.whl; do python -m zipfile -e "$whl" "$OUT/site"; done

"$OUT/bin/redis-server" --version
"$OUT/bin/redis-cli" --version
du -sh "$OUT"
