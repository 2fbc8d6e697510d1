#!/usr/bin/env bash
# A local Apache Kafka (KRaft, no ZooKeeper, no Docker) from Maven Central jars.
#
#   deploy/local/kafka.sh fetch          resolve the pinned Kafka jars (once; reused)
#   deploy/local/kafka.sh start          format storage if new, start, wait until it answers
#   deploy/local/kafka.sh stop           SIGTERM, wait for a clean shutdown (SIGKILL after 60 s)
#   deploy/local/kafka.sh status         exit 0 when every node is running
#   deploy/local/kafka.sh reset          stop and delete the cluster's data
#   deploy/local/kafka.sh stop-node N    stop node N only (SIGTERM: a controlled shutdown, leaders move)
#   deploy/local/kafka.sh kill-node N    SIGKILL node N: a crash, no controlled shutdown
#   deploy/local/kafka.sh start-node N   start node N again, wait until it answers
#   deploy/local/kafka.sh bootstrap      print the bootstrap list, every node (clients need more than
#                                        one address to reach a cluster whose first node is down)
#
# Environment:
#   KAFKA_PORT       first broker port on 127.0.0.1 (default 9092); node i listens on PORT+i-1
#   KAFKA_NODES      nodes in the cluster (default 1). Every node is broker and controller,
#                    so 3 gives a real quorum, replication factor 3 and min.insync 2.
#   SKILLSTATS_STATE_DIR  where jars, data and logs live (default <repo>/.local)
#   KAFKA_HEAP_OPTS  JVM heap (default -Xms256m -Xmx768m)
#   KAFKA_EXTRA_LISTENERS  more listeners for a single node, e.g.
#                    SASL_PLAINTEXT://127.0.0.1:9192,SSL://127.0.0.1:9193 (named after their protocol)
#   KAFKA_EXTRA_CONFIG     a file appended to server.properties (their SASL and TLS settings)
#   KAFKA_PORT_SETTING     the variable a taken port's one line names (default KAFKA_PORT; the
#                    test scripts name theirs, e.g. SKILLSTATS_TEST_KAFKA_PORT)
#
# A cluster is identified by its first port, so a test run on 19092 and a demo on
# 9092 can run side by side without touching each other's data.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$here/lib.sh"
state=${SKILLSTATS_STATE_DIR:-$repo/.local}
port=${KAFKA_PORT:-9092}
nodes=${KAFKA_NODES:-1}
heap=${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m}
libs=$state/kafka-libs
cluster=$state/kafka-$port
controller_base=$((port + 1000))
setting=${KAFKA_PORT_SETTING:-KAFKA_PORT}

log() { printf 'kafka.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

java_bin() {
  if [[ -n "${JAVA_HOME:-}" && -x "$JAVA_HOME/bin/java" ]]; then echo "$JAVA_HOME/bin/java"; else command -v java; fi
}

fetch() {
  local version stamp
  version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")
  stamp=$libs/.resolved-$(sha256sum "$here/kafka/pom.xml" | cut -c1-16)
  if [[ -f $stamp ]]; then return 0; fi
  command -v mvn >/dev/null || die "Maven (mvn) is needed to fetch Kafka $version from Maven Central"
  log "resolving Apache Kafka $version from Maven Central into $libs"
  rm -rf "$libs"
  mkdir -p "$libs"
  mvn -q -B -f "$here/kafka/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$libs" >"$state/kafka-fetch.log" 2>&1 \
    || { cat "$state/kafka-fetch.log" >&2; die "Maven could not resolve Kafka $version"; }
  touch "$stamp"
}

node_dir() { echo "$cluster/node-$1"; }
broker_port() { echo $((port + $1 - 1)); }
controller_port() { echo $((controller_base + $1 - 1)); }
pid_of() { local f; f="$(node_dir "$1")/kafka.pid"; [[ -f $f ]] && cat "$f"; }
alive() { local pid; pid=$(pid_of "$1") && [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }

write_config() {
  local i=$1 dir voters="" rf isr j
  dir=$(node_dir "$i")
  for ((j = 1; j <= nodes; j++)); do voters+="${voters:+,}$j@127.0.0.1:$(controller_port "$j")"; done
  local extra=${KAFKA_EXTRA_LISTENERS:-} protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT" listener
  if [[ -n $extra ]]; then
    ((nodes == 1)) || die "KAFKA_EXTRA_LISTENERS is for a single node"
    for listener in ${extra//,/ }; do protocols+=",${listener%%:*}:${listener%%:*}"; done
  fi
  rf=$((nodes < 3 ? nodes : 3))
  isr=$((rf > 1 ? 2 : 1))
  mkdir -p "$dir/data" "$dir/logs"
  cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$(broker_port "$i"),CONTROLLER://127.0.0.1:$(controller_port "$i")${extra:+,$extra}
advertised.listeners=PLAINTEXT://127.0.0.1:$(broker_port "$i")${extra:+,$extra}
listener.security.protocol.map=$protocols
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
# Topics are created by 'skillstats init' (and faust's own internal topics by faust),
# so a typo in a topic name fails loudly instead of silently creating a new topic.
auto.create.topics.enable=false
# A development broker: consumers join at once instead of waiting 3 s for company.
group.initial.rebalance.delay.ms=0
log.retention.hours=168
EOF
  if [[ -n ${KAFKA_EXTRA_CONFIG:-} ]]; then cat "$KAFKA_EXTRA_CONFIG" >>"$dir/server.properties"; fi
}

start_node() {
  local i=$1 dir java
  dir=$(node_dir "$i")
  java=$(java_bin)
  if alive "$i"; then log "node $i already running (pid $(pid_of "$i"))"; return 0; fi
  write_config "$i"
  if [[ ! -f $dir/data/meta.properties ]]; then
    "$java" -cp "$libs/*" -Dlog4j2.configurationFile="$here/kafka/log4j2.yaml" -Dkafka.logs.dir="$dir/logs" \
      kafka.tools.StorageTool format --ignore-formatted -t "$(cat "$cluster/cluster.id")" \
      -c "$dir/server.properties" >"$dir/logs/format.log" 2>&1 \
      || { cat "$dir/logs/format.log" >&2; die "formatting storage of node $i failed"; }
  fi
  : >"$dir/logs/server.log"
  # setsid: the broker outlives this script and is not killed with its process group.
  # shellcheck disable=SC2086
  setsid "$java" $heap -XX:+UseG1GC -cp "$libs/*" \
    -Dlog4j2.configurationFile="$here/kafka/log4j2.yaml" -Dkafka.logs.dir="$dir/logs" \
    kafka.Kafka "$dir/server.properties" >"$dir/logs/stdout.log" 2>&1 </dev/null &
  echo $! >"$dir/kafka.pid"
}

# start_failure N: the line of node N's logs that says why it stopped (a port taken, a bad setting),
# not the shutdown chatter after it.
start_failure() {
  local logs found
  logs=("$(node_dir "$1")/logs/server.log" "$(node_dir "$1")/logs/stdout.log")
  found=$(grep -hoE "failed to bind to [^ ]+: Address already in use" "${logs[@]}" 2>/dev/null | head -n 1)
  if [[ -n $found ]]; then
    echo "a port is taken: $found; choose other ports with $setting=<port> (node i uses $setting+i-1, and $((controller_base - port)) more for its controller)"
    return
  fi
  found=$(grep -hE "ConfigException|KafkaException|ERROR" "${logs[@]}" 2>/dev/null | head -n 1)
  echo "${found:-see the log}"
}

# check_ports_free N...: nodes N... that are not running find their broker and controller ports free,
# else one line naming the port and the variable that moves it (before the jars are fetched or
# anything is written: another Kafka of this machine on the port would otherwise fail the start later).
check_ports_free() {
  local i
  for i in "$@"; do
    alive "$i" && continue
    if port_in_use "$(broker_port "$i")"; then die "$(port_taken "node $i's broker port" "$(broker_port "$i")" "$setting")"; fi
    if port_in_use "$(controller_port "$i")"; then
      die "$(port_taken "node $i's controller port, $setting+1000+$((i - 1))" "$(controller_port "$i")" "$setting")"
    fi
  done
}

# wait_started [N]: every node, or node N only.
wait_started() {
  local deadline=$((SECONDS + ${KAFKA_START_TIMEOUT:-120})) i ready first=${1:-1} last=${1:-$nodes}
  while :; do
    ready=0
    for ((i = first; i <= last; i++)); do
      alive "$i" || die "node $i exited during start-up: $(start_failure "$i") (full log: $(node_dir "$i")/logs/server.log)"
      if grep -q "Kafka Server started" "$(node_dir "$i")/logs/server.log" 2>/dev/null &&
        (exec 3<>"/dev/tcp/127.0.0.1/$(broker_port "$i")") 2>/dev/null; then
        ready=$((ready + 1))
      fi
    done
    ((ready == last - first + 1)) && return 0
    ((SECONDS < deadline)) || die "Kafka did not start within ${KAFKA_START_TIMEOUT:-120}s; logs in $cluster"
    sleep 0.5
  done
}

bootstrap_list() {
  local i list=""
  [[ -f $cluster/nodes ]] && nodes=$(cat "$cluster/nodes")
  for ((i = 1; i <= nodes; i++)); do list+="${list:+,}127.0.0.1:$(broker_port "$i")"; done
  echo "$list"
}

start() {
  if [[ -f $cluster/nodes && $(cat "$cluster/nodes") != "$nodes" ]]; then
    die "the cluster on port $port was formatted with $(cat "$cluster/nodes") node(s); run '$0 reset' first"
  fi
  check_ports_free $(seq 1 "$nodes")
  fetch
  mkdir -p "$cluster"
  echo "$nodes" >"$cluster/nodes"
  [[ -f $cluster/cluster.id ]] || "$(java_bin)" -cp "$libs/*" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n1 >"$cluster/cluster.id"
  local i
  for ((i = 1; i <= nodes; i++)); do start_node "$i"; done
  wait_started
  log "Kafka running: bootstrap $(bootstrap_list) ($nodes node(s)); logs in $cluster"
}

# stop_nodes N...: SIGTERM to all of them at once, then wait for each (SIGKILL after 60 s).
stop_nodes() {
  local i pid deadline
  for i in "$@"; do alive "$i" && kill -TERM "$(pid_of "$i")"; done
  for i in "$@"; do
    pid=$(pid_of "$i") || continue
    deadline=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null; do
      if ((SECONDS >= deadline)); then log "node $i did not stop in 60s; killing"; kill -KILL "$pid" 2>/dev/null || true; fi
      sleep 0.2
    done
    rm -f "$(node_dir "$i")/kafka.pid"
  done
}

stop() {
  [[ -f $cluster/nodes ]] && nodes=$(cat "$cluster/nodes")
  stop_nodes $(seq 1 "$nodes")
  log "Kafka on port $port stopped"
}

# The node argument of stop-node and start-node, checked against the formatted cluster
# (whose size, not KAFKA_NODES, then sets `nodes`: start_node writes the quorum from it).
check_node_arg() {
  [[ -f $cluster/nodes ]] || die "no cluster on port $port; start it first"
  nodes=$(cat "$cluster/nodes")
  [[ ${1:-} =~ ^[0-9]+$ ]] && ((${1} >= 1 && ${1} <= nodes)) || die "node must be 1..$nodes, got '${1:-}'"
}

status() {
  local i ok=0
  [[ -f $cluster/nodes ]] && nodes=$(cat "$cluster/nodes")
  for ((i = 1; i <= nodes; i++)); do
    if alive "$i"; then echo "node $i: running (pid $(pid_of "$i"), 127.0.0.1:$(broker_port "$i"))"; else echo "node $i: stopped"; ok=1; fi
  done
  return $ok
}

case "${1:-}" in
  fetch) fetch ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  reset) stop; rm -rf "$cluster"; log "deleted $cluster" ;;
  stop-node) check_node_arg "${2:-}"; stop_nodes "$2"; log "node $2 (127.0.0.1:$(broker_port "$2")) stopped" ;;
  kill-node)
    check_node_arg "${2:-}"
    if alive "$2"; then kill -KILL "$(pid_of "$2")"; fi
    stop_nodes "$2" # reaps it and removes the pid file
    log "node $2 (127.0.0.1:$(broker_port "$2")) killed"
    ;;
  start-node) check_node_arg "${2:-}"; check_ports_free "$2"; fetch; start_node "$2"; wait_started "$2"; log "node $2 running" ;;
  bootstrap) bootstrap_list ;;
  *) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
