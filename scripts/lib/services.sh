# Local services for the runner, the tests and the benchmarks: PostgreSQL and moto.
# Sourced by scripts/run-local, scripts/test and scripts/bench; each function exports what it
# started and registers its cleanup.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE_DIR="${WEBHOOKS_STATE_DIR:-$ROOT/target/services}"
mkdir -p "$STATE_DIR"

CLEANUPS=()
cleanup() {
  local i
  for ((i = ${#CLEANUPS[@]} - 1; i >= 0; i--)); do eval "${CLEANUPS[$i]}" || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { say "error: $*"; exit 1; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"
  else return 1
  fi
}

apt_install() {
  command -v apt-get >/dev/null || return 1
  say "installing $* from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2 \
    || { as_root apt-get update -q >&2 && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; }
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {
  local port=$1
  while port_in_use "$port"; do port=$((port + 1)); done
  echo "$port"
}

pg_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  command -v initdb >/dev/null && { dirname "$(command -v initdb)"; return 0; }
  return 1
}

# PostgreSQL's binaries, installing Debian's postgresql when they are missing.
pg_bindir_or_install() {
  pg_bindir && return 0
  apt_install postgresql || die "PostgreSQL's initdb/pg_ctl are missing and could not be installed; install PostgreSQL or set DATABASE_URL"
  pg_bindir || die "initdb not found after installing postgresql"
}

# Initialises and starts a throwaway cluster in DIR on PORT (trust auth, fsync off) with the
# extra server settings SETTINGS and, when given, the pg_hba.conf lines HBA; stopped and
# deleted on exit. initdb refuses to run as root: as root the cluster runs as the unprivileged
# postgres user. Exports PG_BINDIR.
start_cluster() {
  local label=$1 dir=$2 port=$3 settings=$4 hba=${5:-} bindir run=()
  bindir=$(pg_bindir_or_install) || exit 1
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir "$dir" --shell /usr/sbin/nologin postgres
    chown -R postgres "$dir"
    run=(runuser -u postgres --)
  fi
  say "starting $label ($bindir) on 127.0.0.1:$port in $dir"
  "${run[@]}" "$bindir/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >"$dir.initdb.log" 2>&1 \
    || { cat "$dir.initdb.log" >&2; die "initdb failed ($label)"; }
  rm -f "$dir.initdb.log"
  [ -z "$hba" ] || printf '%s\n' "$hba" | "${run[@]}" tee "$dir/data/pg_hba.conf" >/dev/null
  "${run[@]}" "$bindir/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
    -o "-p $port -k $dir -c fsync=off -c synchronous_commit=off -c full_page_writes=off $settings" \
    start >/dev/null || { cat "$dir/postgres.log" >&2; die "$label did not start"; }
  CLEANUPS+=("${run[*]} '$bindir/pg_ctl' -D '$dir/data' -m immediate stop >/dev/null 2>&1; rm -rf '$dir'")
  export PG_BINDIR="$bindir"
}

# Starts a throwaway cluster and exports DATABASE_URL.
start_throwaway_postgres() {
  local dir port
  dir=$(mktemp -d "${TMPDIR:-/tmp}/webhooks-pg.XXXXXX")
  port=$(free_port 55432)
  start_cluster "a throwaway PostgreSQL" "$dir" "$port" \
    "-c listen_addresses=127.0.0.1 -c max_connections=300"
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
}

# Starts a second throwaway cluster that speaks TLS only, as RDS does with rds.force_ssl=1: its
# own private CA signs the server certificate (for 127.0.0.1 and localhost; it also listens on
# 127.0.0.2, a name the certificate does not hold), pg_hba.conf admits hostssl and nothing else,
# so a plaintext connection is refused. Exports TLS_DATABASE_URL (verify-full against that CA)
# and TLS_TEST_DIR, which also holds untrusted-ca.pem, a CA that signed nothing the server
# presents.
start_tls_postgres() {
  command -v openssl >/dev/null || apt_install openssl || die "openssl is needed for the TLS test server"
  local dir port
  dir=$(mktemp -d "${TMPDIR:-/tmp}/webhooks-pg-tls.XXXXXX")
  chmod 755 "$dir"
  port=$(free_port 56432)
  (
    cd "$dir"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=webhooks test CA" \
      -keyout ca.key -out ca.pem
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=untrusted test CA" \
      -keyout untrusted-ca.key -out untrusted-ca.pem
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
      -extfile server.ext -out server.pem
    chmod 600 server.key
  ) >"$STATE_DIR/tls-certs.log" 2>&1 || { cat "$STATE_DIR/tls-certs.log" >&2; die "could not make the TLS test certificates"; }
  start_cluster "a TLS-only PostgreSQL" "$dir" "$port" \
    "-c listen_addresses=127.0.0.1,127.0.0.2 -c max_connections=100 -c ssl=on -c ssl_cert_file=$dir/server.pem -c ssl_key_file=$dir/server.key" \
    "$(printf 'local all all trust\nhostssl all all 127.0.0.0/8 trust\nhostssl all all ::1/128 trust')"
  export TLS_DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres?sslmode=verify-full&sslrootcert=$dir/ca.pem"
  export TLS_TEST_DIR="$dir"
}

# Starts a third throwaway cluster that checks passwords, as RDS does: pg_hba.conf trusts the
# postgres superuser (the tests' admin) and asks every other role for its password
# (scram-sha-256). The credential-rotation tests create a role there, change its password and
# watch a warm function reconnect. Exports PASSWORD_DATABASE_URL (the admin's URL).
start_password_postgres() {
  local dir port
  dir=$(mktemp -d "${TMPDIR:-/tmp}/webhooks-pg-password.XXXXXX")
  chmod 755 "$dir"
  port=$(free_port 56532)
  start_cluster "a password-checking PostgreSQL" "$dir" "$port" \
    "-c listen_addresses=127.0.0.1 -c max_connections=100 -c password_encryption=scram-sha-256" \
    "$(printf 'local all all trust\nhost all postgres 127.0.0.0/8 trust\nhost all all 127.0.0.0/8 scram-sha-256\nhost all postgres ::1/128 trust\nhost all all ::1/128 scram-sha-256')"
  export PASSWORD_DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
}

# DATABASE_URL if set, else the server on 127.0.0.1:5432 if it answers, else a throwaway cluster.
ensure_test_postgres() {
  if [ -n "${DATABASE_URL:-}" ]; then
    say "using DATABASE_URL from the environment"
  elif port_in_use 5432 && command -v psql >/dev/null \
      && psql "postgres://postgres@127.0.0.1:5432/postgres" -qtAc 'select 1' >/dev/null 2>&1; then
    say "using the PostgreSQL server on 127.0.0.1:5432"
    export DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres"
  else
    start_throwaway_postgres
  fi
}

# DATABASE_URL if set, else a throwaway cluster (the local runner never touches a shared server
# unless told to).
ensure_runner_postgres() {
  if [ -n "${DATABASE_URL:-}" ]; then
    say "using DATABASE_URL from the environment"
  else
    start_throwaway_postgres
  fi
}

moto_python() {
  local py
  for py in "${MOTO_PYTHON:-}" python3 "$STATE_DIR/moto-venv/bin/python"; do
    [ -n "$py" ] && command -v "$py" >/dev/null && "$py" -c 'import moto.server, flask' >/dev/null 2>&1 && { echo "$py"; return 0; }
  done
  return 1
}

install_moto() {
  command -v python3 >/dev/null || apt_install python3 python3-venv || die "python3 is needed for moto"
  say "installing moto[server] from PyPI into $STATE_DIR/moto-venv"
  if ! python3 -m venv "$STATE_DIR/moto-venv" >/dev/null 2>&1; then
    apt_install python3-venv >/dev/null 2>&1 || true
    rm -rf "$STATE_DIR/moto-venv"
    python3 -m venv "$STATE_DIR/moto-venv" >&2 || die "python3 -m venv failed; install python3-venv"
  fi
  "$STATE_DIR/moto-venv/bin/pip" install -q 'moto[server]' >&2 || die "pip install moto[server] failed"
}

# Starts moto in server mode (a local Secrets Manager and SQS) and exports MOTO_ENDPOINT.
start_moto() {
  local py port i
  py=$(moto_python) || { install_moto; py=$(moto_python) || die "moto is not importable after installing it"; }
  port=$(free_port 55500)
  "$py" -m moto.server -H 127.0.0.1 -p "$port" >"$STATE_DIR/moto.log" 2>&1 &
  local pid=$!
  CLEANUPS+=("kill $pid 2>/dev/null; wait $pid 2>/dev/null")
  for i in $(seq 1 100); do
    port_in_use "$port" && break
    kill -0 "$pid" 2>/dev/null || { cat "$STATE_DIR/moto.log" >&2; die "moto exited"; }
    sleep 0.1
  done
  port_in_use "$port" || die "moto did not listen on $port"
  say "moto (Secrets Manager, SQS) on 127.0.0.1:$port"
  export MOTO_ENDPOINT="http://127.0.0.1:$port"
  # Credentials and region for the AWS SDK; moto accepts any.
  export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1
  unset AWS_PROFILE AWS_SESSION_TOKEN
}

# cfn-lint, from PyPI into the same venv as moto when the machine has none.
ensure_cfn_lint() {
  if command -v cfn-lint >/dev/null; then CFN_LINT=(cfn-lint); return 0; fi
  if [ -x "$STATE_DIR/moto-venv/bin/cfn-lint" ]; then CFN_LINT=("$STATE_DIR/moto-venv/bin/cfn-lint"); return 0; fi
  [ -x "$STATE_DIR/moto-venv/bin/pip" ] || install_moto
  say "installing cfn-lint from PyPI into $STATE_DIR/moto-venv"
  "$STATE_DIR/moto-venv/bin/pip" install -q cfn-lint >&2 || die "pip install cfn-lint failed"
  CFN_LINT=("$STATE_DIR/moto-venv/bin/cfn-lint")
}

# Debian's chromium and chromium-driver, for the console's browser test (cli/tests/console.rs
# drives a headless Chromium through chromedriver). Exports CHROMEDRIVER and CHROMIUM.
ensure_chromium() {
  local chromium
  chromium=$(command -v chromium || command -v chromium-browser || true)
  if [ -z "$chromium" ] || ! command -v chromedriver >/dev/null; then
    apt_install chromium chromium-driver || die "the console's browser test needs chromium and chromium-driver (Debian's packages)"
    chromium=$(command -v chromium)
  fi
  export CHROMIUM="$chromium" CHROMEDRIVER="$(command -v chromedriver)"
}

# The Standard Webhooks reference library (PyPI `standardwebhooks`): the tests verify the
# outbox's signed deliveries with it, independently of this code. From python3 when it has the
# library, else from PyPI into a venv under $STATE_DIR. Exports STANDARD_WEBHOOKS_PYTHON.
ensure_standard_webhooks() {
  local py
  for py in "${STANDARD_WEBHOOKS_PYTHON:-}" python3 "$STATE_DIR/verifier-venv/bin/python"; do
    if [ -n "$py" ] && command -v "$py" >/dev/null && "$py" -c 'import standardwebhooks' >/dev/null 2>&1; then
      export STANDARD_WEBHOOKS_PYTHON="$py"
      return 0
    fi
  done
  command -v python3 >/dev/null || apt_install python3 python3-venv || die "python3 is needed for the Standard Webhooks reference library"
  say "installing standardwebhooks from PyPI into $STATE_DIR/verifier-venv"
  rm -rf "$STATE_DIR/verifier-venv"
  if ! python3 -m venv "$STATE_DIR/verifier-venv" >/dev/null 2>&1; then
    apt_install python3-venv >/dev/null 2>&1 || true
    rm -rf "$STATE_DIR/verifier-venv"
    python3 -m venv "$STATE_DIR/verifier-venv" >&2 || die "python3 -m venv failed; install python3-venv"
  fi
  "$STATE_DIR/verifier-venv/bin/pip" install -q standardwebhooks >&2 || die "pip install standardwebhooks failed"
  export STANDARD_WEBHOOKS_PYTHON="$STATE_DIR/verifier-venv/bin/python"
}
