#!/usr/bin/env bash
# A local Kubernetes control plane (no Docker, no kubelet) for the deploy tests: etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and kwok, built from the Go
# module proxy at the versions pinned in deploy/local/kube/go.mod, on loopback ports.
# kwok plays the kubelet of one fake node: pods scheduled there are reported Running
# and Ready, and a Job's pods Completed, without any container being run.
#
#   deploy/local/kube.sh build       build the binaries into .local/kube/bin and generate the
#                                    CRDs into .local/kube/crds (again only when deploy/local/kube/
#                                    or the Go version changes)
#   deploy/local/kube.sh start       build if needed, start everything, create the fake node,
#                                    install the CRDs; prints where it runs and the kubeconfig
#   deploy/local/kube.sh stop        stop every process of the cluster (nothing running: no-op)
#   deploy/local/kube.sh status      exit 0 when every process runs and the API server is ready
#   deploy/local/kube.sh kubeconfig  print the path of the admin kubeconfig
#   deploy/local/kube.sh reset       stop and delete the cluster's state (etcd data, keys)
#
# Environment:
#   KUBE_PORT            kube-apiserver's port on 127.0.0.1 (default 16443); the controller
#                        manager serves its health on KUBE_PORT+1, the scheduler on KUBE_PORT+2
#   KUBE_ETCD_PORT       etcd's client port (default 12379)
#   KUBE_ETCD_PEER_PORT  etcd's peer port (default 12380)
#   SKILLSTATS_STATE_DIR where binaries and clusters live (default <repo>/.local)
#
# A cluster is identified by its API server port: its certificates, keys, tokens, etcd
# data and logs are in .local/kube-<port>/, the binaries (shared) in .local/kube/.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source=deploy/local/lib.sh
source "$here/lib.sh"
state=${SKILLSTATS_STATE_DIR:-$repo/.local}
module=$here/kube  # the control plane's wrapper module
crd_module=$module/crd # controller-gen and the API types of KEDA and the Prometheus Operator
tools=$state/kube
bin=$tools/bin
crds=$tools/crds
port=${KUBE_PORT:-16443}
etcd_port=${KUBE_ETCD_PORT:-12379}
etcd_peer_port=${KUBE_ETCD_PEER_PORT:-12380}
cm_port=$((port + 1))
scheduler_port=$((port + 2))
cluster=$state/kube-$port
node="kwok-node-0"
# Started in this order, stopped in the reverse one.
components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
# The CRDs the manifests use, by the file names controller-gen gives them.
wanted_crds=(
  keda.sh_scaledobjects.yaml
  keda.sh_triggerauthentications.yaml
  monitoring.coreos.com_podmonitors.yaml
  monitoring.coreos.com_servicemonitors.yaml
  monitoring.coreos.com_prometheusrules.yaml
)

log() { printf 'kube.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# GOTOOLCHAIN=local: build with the Go that is installed, never download another one.
# The module and build caches are the user's defaults, so a second build is fast.
gocmd() { GOTOOLCHAIN=local go "$@"; }

# ------------------------------------------------------------------------- build

module_version() { (cd "$module" && gocmd list -m -f '{{.Version}}' "$1"); }

# What the binaries are built from: the modules' files and the Go that compiles them.
build_inputs_hash() {
  {
    cat "$module/go.mod" "$module/go.sum" "$module/tools.go" "$module/kwok-stages"
    cat "$crd_module/go.mod" "$crd_module/go.sum" "$crd_module/tools.go"
    gocmd version
  } | sha256sum | cut -c1-16
}

build_stamp() { echo "$tools/.built-$(build_inputs_hash)"; }

binaries_present() {
  local b
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok controller-gen; do
    [[ -x $bin/$b ]] || return 1
  done
  [[ -f $tools/kwok.yaml ]] && [[ -d $crds ]]
}

build() {
  command -v go >/dev/null || die "Go is needed to build the control plane (deploy/local/kube/go.mod)"
  local stamp started version ldflags pkg
  stamp=$(build_stamp)
  if [[ -f $stamp ]] && binaries_present; then
    log "binaries are current ($bin)"
    return 0
  fi
  started=$SECONDS
  version=$(module_version k8s.io/kubernetes)
  [[ $version =~ ^v([0-9]+)\.([0-9]+)\. ]] || die "unexpected k8s.io/kubernetes version '$version'"
  # What hack/lib/version.sh stamps into a release build, so that `kubectl version`, the
  # API server's /version and the components' --version say the real release (a module
  # build leaves the placeholder v0.0.0-master). The git commit is not in the module zip.
  ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=${BASH_REMATCH[1]}"
    ldflags+=" -X $pkg.gitMinor=${BASH_REMATCH[2]} -X $pkg.gitTreeState=clean"
  done
  say "building Kubernetes $version, etcd $(module_version go.etcd.io/etcd/server/v3) and kwok $(module_version sigs.k8s.io/kwok) into $bin (a cold build takes several minutes)"
  mkdir -p "$bin"
  # One `go build` for all six commands: their shared packages are compiled once.
  # -trimpath: no local paths in the binaries, the same bytes on every machine.
  (cd "$module" && gocmd build -trimpath -ldflags "$ldflags" -o "$bin/" \
    go.etcd.io/etcd/server/v3 \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    sigs.k8s.io/kwok/cmd/kwok)
  mv "$bin/server" "$bin/etcd" # go names etcd's main package after its directory, server/v3
  (cd "$crd_module" && gocmd build -trimpath -ldflags "-s -w" -o "$bin/controller-gen" \
    sigs.k8s.io/controller-tools/cmd/controller-gen)
  write_kwok_config
  generate_crds
  rm -f "$tools"/.built-*
  touch "$stamp"
  log "built in $((SECONDS - started))s: $("$bin/kubectl" version --client 2>/dev/null | head -n1), $("$bin/etcd" --version | head -n1), $("$bin/kwok" --version 2>/dev/null | head -n1)"
}

# kwok's stages, copied from the pinned kwok module (deploy/local/kube/kwok-stages says which).
write_kwok_config() {
  local dir stage
  dir=$(cd "$module" && gocmd list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  {
    echo "# Written by deploy/local/kube.sh build from $(basename "$dir"); see deploy/local/kube/kwok-stages"
    grep -v -e '^#' -e '^$' "$module/kwok-stages" | while read -r stage; do
      echo "---"
      cat "$dir/$stage"
    done
  } >"$tools/kwok.yaml.new"
  mv "$tools/kwok.yaml.new" "$tools/kwok.yaml"
}

# The CRDs, generated by controller-gen from the API types of the pinned KEDA and
# Prometheus Operator modules (what those projects generate theirs from), run inside the
# crd module so the import paths resolve to those versions. Only the kinds the manifests use.
generate_crds() {
  local out f
  out=$(mktemp -d)
  (cd "$crd_module" && "$bin/controller-gen" crd \
    paths=github.com/kedacore/keda/v2/apis/keda/v1alpha1 \
    paths=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1 \
    output:crd:dir="$out") || { rm -rf "$out"; die "controller-gen failed"; }
  rm -rf "$crds"
  mkdir -p "$crds"
  for f in "${wanted_crds[@]}"; do
    [[ -f $out/$f ]] || { rm -rf "$out"; die "controller-gen wrote no $f (it wrote: $(cd "$out" && echo *))"; }
    mv "$out/$f" "$crds/"
  done
  rm -rf "$out"
  log "CRDs in $crds: ${wanted_crds[*]}"
}

# ------------------------------------------------------------------------- run

pid_file() { echo "$cluster/$1.pid"; }
pid_of() { local f; f=$(pid_file "$1"); [[ -f $f ]] && cat "$f"; }
# alive NAME: its pid file names a live process that runs NAME's binary (not another
# process that got the pid after a reboot, which stop would otherwise kill).
alive() {
  local pid
  pid=$(pid_of "$1") && [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$bin/$1 "
}
log_of() { echo "$cluster/logs/$1.log"; }
kubeconfig_path() { echo "$cluster/kubeconfig"; }
kubectl_admin() { "$bin/kubectl" --kubeconfig "$(kubeconfig_path)" "$@"; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# port_user PORT: the process listening there, when ss can tell.
port_user() {
  local found
  found=$(ss -Hltnp "sport = :$1" 2>/dev/null | grep -o 'users:(([^)]*))' | head -n1) || true
  echo "${found:-another process}"
}

check_ports() {
  local spec name p var hint
  for spec in "kube-apiserver:$port:KUBE_PORT:" \
    "kube-controller-manager:$cm_port:KUBE_PORT: (the controller manager uses KUBE_PORT+1)" \
    "kube-scheduler:$scheduler_port:KUBE_PORT: (the scheduler uses KUBE_PORT+2)" \
    "etcd:$etcd_port:KUBE_ETCD_PORT:" "etcd peer:$etcd_peer_port:KUBE_ETCD_PEER_PORT:"; do
    IFS=: read -r name p var hint <<<"$spec"
    if port_in_use "$p"; then
      die "port 127.0.0.1:$p ($name) is taken by $(port_user "$p"); choose another with $var=...$hint"
    fi
  done
}

# start_failure NAME: the line of NAME's log that says why it stopped.
start_failure() {
  local found
  found=$(grep -hoiE "(listen|bind)[^\"]*address already in use" "$(log_of "$1")" 2>/dev/null | head -n1)
  if [[ -n $found ]]; then
    echo "a port is taken: $found; choose other ports with KUBE_PORT=..., KUBE_ETCD_PORT=..., KUBE_ETCD_PEER_PORT=..."
    return
  fi
  found=$(grep -hE '^(E[0-9]{4}|F[0-9]{4}|Error:)|"level":"(fatal|panic)"|run.go.*error' "$(log_of "$1")" 2>/dev/null | tail -n1)
  echo "${found:-see the log}"
}

# wait_for NAME SECONDS COMMAND...: until COMMAND succeeds; dies when NAME exits first.
wait_for() {
  local name=$1 timeout=$2 deadline=$((SECONDS + $2))
  shift 2
  until "$@" >/dev/null 2>&1; do
    alive "$name" || die "$name exited during start-up: $(start_failure "$name") (full log: $(log_of "$name"))"
    ((SECONDS < deadline)) || die "$name was not ready within ${timeout}s; log: $(log_of "$name")"
    sleep 0.3
  done
}

# launch NAME COMMAND...: in the background, detached (setsid: it outlives this script
# and is not killed with its process group), its output in logs/NAME.log.
launch() {
  local name=$1
  shift
  if alive "$name"; then log "$name already running (pid $(pid_of "$name"))"; return 0; fi
  : >"$(log_of "$name")"
  setsid "$@" >>"$(log_of "$name")" 2>&1 </dev/null &
  echo $! >"$(pid_file "$name")"
}

write_kubeconfig() { # FILE USER TOKEN
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: skillstats-local
    cluster:
      server: https://127.0.0.1:$port
      certificate-authority: $cluster/pki/ca.crt
users:
  - name: $2
    user:
      token: $3
contexts:
  - name: skillstats-local
    context: { cluster: skillstats-local, user: $2 }
current-context: skillstats-local
EOF
  chmod 600 "$1"
}

# A CA of the cluster's own, and the certificates it issues: the API server's serving one
# (the kubeconfigs trust the CA; the controller manager publishes it to pods as
# kube-root-ca.crt and signs CSRs with it) and the front proxy's client one (the API
# server's aggregation layer; the controller manager and scheduler look its CA up). The
# API server's self-signed fallback would put its serving certificate first in the bundle,
# which the controller manager then refuses to publish as a CA.
make_pki() {
  local pki=$cluster/pki
  [[ -f $pki/ca.crt && -f $pki/apiserver.crt && -f $pki/front-proxy-client.crt ]] && return 0
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=skillstats-local-ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  # The names a client may use for the API server: the loopback address, the in-cluster ones.
  issue apiserver kube-apiserver serverAuth \
    "IP:127.0.0.1,DNS:localhost,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  issue front-proxy-client front-proxy-client clientAuth ""
}

# issue NAME CN USAGE SANS: pki/NAME.{key,crt}, signed by pki/ca.
issue() {
  local pki=$cluster/pki
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$pki/$1.key" -out "$pki/$1.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -out "$pki/$1.crt" -extfile <(
      [[ -z $4 ]] || echo "subjectAltName=$4"
      echo "basicConstraints=CA:FALSE"
      echo "keyUsage=critical,digitalSignature,keyEncipherment"
      echo "extendedKeyUsage=$3"
    ) 2>/dev/null
  rm -f "$pki/$1.csr"
}

# Keys and identities, made once per cluster and kept across restarts (etcd keeps the
# objects, and the service account tokens in them are signed with sa.key).
prepare_cluster_dir() {
  mkdir -p "$cluster/pki" "$cluster/logs" "$cluster/etcd"
  chmod 700 "$cluster" "$cluster/pki" "$cluster/etcd"
  make_pki
  if [[ ! -f $cluster/pki/sa.key ]]; then
    openssl genrsa -out "$cluster/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$cluster/pki/sa.key" -pubout -out "$cluster/pki/sa.pub" 2>/dev/null
  fi
  if [[ ! -f $cluster/tokens.csv ]]; then
    # Static bearer tokens (--token-auth-file): token,user,uid,"groups". The admin, and kwok
    # (it writes node and pod status of every kind), are cluster admins; the controller
    # manager and the scheduler get the identities their bootstrap RBAC roles name.
    local admin cm scheduler kwok
    admin=$(openssl rand -hex 24) cm=$(openssl rand -hex 24)
    scheduler=$(openssl rand -hex 24) kwok=$(openssl rand -hex 24)
    {
      echo "$admin,skillstats-admin,skillstats-admin,\"system:masters\""
      echo "$cm,system:kube-controller-manager,system:kube-controller-manager"
      echo "$scheduler,system:kube-scheduler,system:kube-scheduler"
      echo "$kwok,kwok-controller,kwok-controller,\"system:masters\""
    } >"$cluster/tokens.csv"
    chmod 600 "$cluster/tokens.csv"
    write_kubeconfig "$cluster/kubeconfig" skillstats-admin "$admin"
    write_kubeconfig "$cluster/controller-manager.kubeconfig" system:kube-controller-manager "$cm"
    write_kubeconfig "$cluster/scheduler.kubeconfig" system:kube-scheduler "$scheduler"
    write_kubeconfig "$cluster/kwok.kubeconfig" kwok-controller "$kwok"
  fi
}

start_etcd() {
  # --unsafe-no-fsync: throwaway test data (as postgres.sh's fsync=off); a crash of the
  # machine could lose it, never a kill of a client.
  launch etcd "$bin/etcd" --name "kube-$port" --data-dir "$cluster/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "kube-$port=http://127.0.0.1:$etcd_peer_port" \
    --unsafe-no-fsync --log-level warn
  wait_for etcd 60 curl -fsS "http://127.0.0.1:$etcd_port/health"
}

start_apiserver() {
  # --allow-privileged=true: with the default (false) the API server itself refuses every
  # privileged container, before Pod Security runs; the tests' negative controls must be
  # refused by Pod Security's restricted profile, as they would be on a real cluster.
  # --endpoint-reconciler-type none: no Endpoints for the `kubernetes` Service pointing
  # at 127.0.0.1 (which the API server refuses to reconcile anyway).
  # --client-ca-file, --requestheader-*: clients log in with the tokens, but the controller
  # manager and the scheduler look both CAs up in the ConfigMap the API server writes from these.
  launch kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$port" \
    --tls-cert-file "$cluster/pki/apiserver.crt" --tls-private-key-file "$cluster/pki/apiserver.key" \
    --token-auth-file "$cluster/tokens.csv" \
    --client-ca-file "$cluster/pki/ca.crt" \
    --requestheader-client-ca-file "$cluster/pki/ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$cluster/pki/front-proxy-client.crt" \
    --proxy-client-key-file "$cluster/pki/front-proxy-client.key" \
    --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$cluster/pki/sa.pub" \
    --service-account-signing-key-file "$cluster/pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --endpoint-reconciler-type none \
    --allow-privileged=true
  wait_for kube-apiserver 120 kubectl_admin get --raw /readyz
}

start_controllers() {
  # --use-service-account-credentials: each controller acts as its own service account,
  # with the RBAC roles a real cluster gives it (as kubeadm sets it up).
  # --leader-elect=false: one instance of each; no lease to wait for.
  # --flex-volume-plugin-dir: by default it creates /usr/libexec/kubernetes/... on the host.
  launch kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$cluster/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$cluster/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$cluster/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$cm_port" --cert-dir "$cluster/pki/controller-manager" \
    --use-service-account-credentials \
    --service-account-private-key-file "$cluster/pki/sa.key" \
    --root-ca-file "$cluster/pki/ca.crt" \
    --cluster-signing-cert-file "$cluster/pki/ca.crt" --cluster-signing-key-file "$cluster/pki/ca.key" \
    --flex-volume-plugin-dir "$cluster/flexvolume" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --leader-elect=false
  launch kube-scheduler "$bin/kube-scheduler" \
    --kubeconfig "$cluster/scheduler.kubeconfig" \
    --authentication-kubeconfig "$cluster/scheduler.kubeconfig" \
    --authorization-kubeconfig "$cluster/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$scheduler_port" --cert-dir "$cluster/pki/scheduler" \
    --leader-elect=false
  # kwok manages only nodes annotated as its own (never one a real kubelet runs), and
  # serves nothing (no --server-address: no pod logs or exec, no port taken).
  launch kwok "$bin/kwok" --kubeconfig "$cluster/kwok.kubeconfig" --config "$tools/kwok.yaml" \
    --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --node-lease-duration-seconds 40
  wait_for kube-controller-manager 60 curl -kfsS "https://127.0.0.1:$cm_port/healthz"
  wait_for kube-scheduler 60 curl -kfsS "https://127.0.0.1:$scheduler_port/healthz"
}

# One fake node, big enough for every manifest's requests, with the labels the topology
# spread constraints use; no taint, so unmodified manifests schedule onto it.
create_node() {
  kubectl_admin apply --server-side --field-manager kube.sh -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $node
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/hostname: $node
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    topology.kubernetes.io/zone: local-a
status:
  allocatable: { cpu: "64", memory: 256Gi, pods: "110" }
  capacity: { cpu: "64", memory: 256Gi, pods: "110" }
EOF
  wait_for kwok 60 kubectl_admin wait --for condition=Ready "node/$node" --timeout 2s
}

install_crds() {
  kubectl_admin apply --server-side --field-manager kube.sh -f "$crds" >/dev/null
  kubectl_admin wait --for condition=Established -f "$crds" --timeout 60s >/dev/null \
    || die "the CRDs in $crds were not Established within 60s"
}

start() {
  local started=$SECONDS
  build
  prepare_cluster_dir
  if status >/dev/null 2>&1; then
    log "already running: https://127.0.0.1:$port; kubeconfig $(kubeconfig_path)"
    return 0
  fi
  stop_all quiet # a partly running cluster (one process died): start it whole
  check_ports
  start_etcd
  start_apiserver
  start_controllers
  create_node
  install_crds
  log "Kubernetes $(module_version k8s.io/kubernetes) running on https://127.0.0.1:$port (etcd 127.0.0.1:$etcd_port, kwok node $node), started in $((SECONDS - started))s; kubeconfig $(kubeconfig_path), logs in $cluster/logs"
}

# stop_all [quiet]: SIGTERM to each process, newest first, each waited for (SIGKILL after 30 s).
stop_all() {
  local i name pid deadline stopped=0
  for ((i = ${#components[@]} - 1; i >= 0; i--)); do
    name=${components[i]}
    if alive "$name"; then
      pid=$(pid_of "$name")
      kill -TERM "$pid" 2>/dev/null || true
      deadline=$((SECONDS + 30))
      while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
          log "$name did not stop in 30s; killing it"
          kill -KILL "$pid" 2>/dev/null || true
          deadline=$((SECONDS + 30))
        fi
        sleep 0.2
      done
      stopped=$((stopped + 1))
    fi
    rm -f "$(pid_file "$name")"
  done
  [[ ${1:-} == quiet ]] || log "Kubernetes on port $port: $stopped process(es) stopped"
}

status() {
  local name ok=0
  for name in "${components[@]}"; do
    if alive "$name"; then echo "$name: running (pid $(pid_of "$name"))"; else echo "$name: stopped"; ok=1; fi
  done
  if ((ok == 0)) && kubectl_admin get --raw /readyz >/dev/null 2>&1; then
    echo "API server: ready on https://127.0.0.1:$port"
  else
    echo "API server: not ready"
    ok=1
  fi
  return $ok
}

case "${1:-}" in
  build) build ;;
  start) start ;;
  stop) stop_all ;;
  status) status ;;
  kubeconfig) kubeconfig_path ;;
  reset) stop_all; rm -rf "$cluster"; log "deleted $cluster" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
