# Shared by deploy/local/*.sh: the project's Python environment and system tools.
# shellcheck shell=bash

repo=${repo:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
venv=${SKILLSTATS_VENV:-$repo/.venv}

say() { printf '\n== %s\n' "$*" >&2; }

# port_in_use PORT: something accepts connections on 127.0.0.1:PORT (bash's /dev/tcp: no nc or ss
# needed). A listener on 0.0.0.0 answers there too. A socket bound but not listening does not: the
# server's own bind error says that case.
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# port_taken WHAT PORT VARIABLE: the one line that says a port is taken and which variable moves it.
port_taken() {
  echo "127.0.0.1:$2 ($1) is taken by another program; choose another port with $3=<port>"
}

# A virtualenv with skillstats (editable) and the pinned versions in
# requirements.lock; re-installed (and the C module rebuilt) when pyproject.toml, the
# lock, setup.py or skillstats/_native.c changes.
ensure_python_env() {
  local python=${PYTHON:-python3} stamp
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "Python 3.11 or newer is needed ($python is $("$python" --version 2>&1))" >&2; return 1; }
  [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
  stamp=$venv/.skillstats-$(cat "$repo/pyproject.toml" "$repo/requirements.lock" "$repo/setup.py" \
    "$repo/skillstats/_native.c" | sha256sum | cut -c1-16)
  if [[ ! -f $stamp ]]; then
    say "installing Python dependencies into $venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -c "$repo/requirements.lock" -e "${repo}[test]"
    touch "$stamp"
  fi
  export PATH="$venv/bin:$PATH"
}

# Debian packages the tests use, installed when their command is missing.
ensure_debian_tools() {
  local missing=() sudo=""
  command -v kcat >/dev/null || missing+=(kcat)
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
  command -v promtool >/dev/null || missing+=(prometheus) # prometheus and promtool, for the alert tests
  command -v openssl >/dev/null || missing+=(openssl)     # certificates for the TLS tests
  command -v sqlite3 >/dev/null || missing+=(sqlite3)     # the README's Getting started, which a test runs
  ((${#missing[@]})) || return 0
  say "installing Debian packages: ${missing[*]}"
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The TypeScript client (clients/typescript), built with its locked npm packages:
# `npm ci` again only when package-lock.json changed, `tsc` every time (a second).
ensure_typescript_client() {
  local dir=$repo/clients/typescript stamp
  command -v node >/dev/null || { echo "Node 18 or newer is needed for clients/typescript" >&2; return 1; }
  stamp=$dir/node_modules/.skillstats-$(sha256sum <"$dir/package-lock.json" | cut -c1-16)
  if [[ ! -f $stamp ]]; then
    say "installing the TypeScript client's npm packages"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >&2)
    touch "$stamp"
  fi
  (cd "$dir" && rm -rf dist && npx --no-install tsc -p . >&2)
}

# A kustomize for rendering deploy/k8s: kubectl's built-in one where kubectl exists,
# else kustomize built from the Go module proxy into .local/bin (once). Prints the
# command to run, e.g. "kubectl kustomize" or ".local/bin/kustomize build".
ensure_kustomize() {
  if command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; then
    echo "kubectl kustomize"
    return
  fi
  local bin=$repo/.local/bin/kustomize
  if [[ ! -x $bin ]]; then
    say "building kustomize from the Go module proxy (once)"
    GOTOOLCHAIN=local GOBIN=$repo/.local/bin GOPATH=$repo/.local/go GOMODCACHE=$repo/.local/go/mod \
      go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0 >&2
  fi
  echo "$bin build"
}
