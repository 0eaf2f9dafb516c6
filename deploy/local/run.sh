#!/usr/bin/env bash
# A whole wsd cluster on this machine, as `wsd up` starts it, as a script to
# read and adapt: a coordinator (`wsd coordinator`) and NPROC workers under
# `torchrun --standalone`, until Ctrl-C or SIGTERM, which stop the workers
# (each at the same step), then torchrun, then the coordinator. With
# ENGINE=vllm, vLLM's OpenAI API server instead of torchrun: its NPROC workers
# (tensor parallel) load wsd's plugin and join the coordinator.
#
# Knobs (environment variables):
#   ENGINE         wsd (default: the built-in engine loop) or vllm (vLLM installed)
#   NPROC          worker processes (default 2); with ENGINE=vllm, vLLM's TP size
#   CONFIG         TOML configuration read by the coordinator and every worker
#                  (default: wsd.toml beside this script; empty: built-in defaults)
#   SHOW_RANKS     local ranks whose output reaches the terminal, comma-separated,
#                  torchrun's --local-ranks-filter (default 0; empty: every rank)
#   LOG_DIR        every rank's output also goes to files under it, the hidden
#                  ranks' too (torchrun --log-dir --tee 3); empty (default): the
#                  output of ranks SHOW_RANKS hides is discarded
#   PYTHON         interpreter with wsd and torch installed (default python3)
#   WORKER_ARGS    extra arguments of `python -m wsd.worker`, e.g. --idle
#   VLLM_MODEL     ENGINE=vllm: the model vLLM serves (required), a name or a folder
#   VLLM_ARGS      ENGINE=vllm: more arguments of vLLM's server, e.g. --max-model-len 4096
#   API_PORT       ENGINE=vllm: the port of vLLM's API on 127.0.0.1 (default 8000)
#   WSD_ENGINE     ENGINE=vllm: the wsd engine of vLLM's ranks, the coordinator's
#                  default one (default: vllm)
#   READY_TIMEOUT  seconds to wait for the coordinator to bind (default 30)
#   STOP_GRACE     seconds the workers get to stop after SIGTERM (default 15; with
#                  ENGINE=vllm, after vLLM's own 10 s to drain its requests)
#   OMP_NUM_THREADS torch threads per worker (default: this machine's CPUs
#                  divided by NPROC, at least 1, as `wsd up` does; torchrun
#                  would pick 1 and print a banner about it)
#   WSD_AGENT_TOKEN the agent token (default: one made up for this run, as
#                  `wsd up` does: only the workers started here can register)
#   WSD_*          any configuration key, e.g. WSD_WORKSPACE_NUM_UBATCHES=2 or
#                  WSD_COORDINATOR_CLIENT_ENDPOINT=tcp://127.0.0.1:0 (ports the OS picks)
#
# Exit code: 0 when stopped by a signal or when the workers finished cleanly,
# 2 for a bad knob or configuration, 1 otherwise.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ENGINE=${ENGINE:-wsd}
NPROC=${NPROC:-2}
CONFIG=${CONFIG-$HERE/wsd.toml}
SHOW_RANKS=${SHOW_RANKS-0}
LOG_DIR=${LOG_DIR:-}
PYTHON=${PYTHON:-python3}
WORKER_ARGS=${WORKER_ARGS:-}
VLLM_MODEL=${VLLM_MODEL:-}
VLLM_ARGS=${VLLM_ARGS:-}
API_PORT=${API_PORT:-8000}
READY_TIMEOUT=${READY_TIMEOUT:-30}
STOP_GRACE=${STOP_GRACE:-15}
# torchrun gives its workers 30 s between SIGTERM and SIGKILL: wait a little longer.
TORCHRUN_GRACE=35
COORDINATOR_GRACE=10

say() { printf 'wsd-local: %s\n' "$*"; }
die() { printf 'wsd-local: %s\n' "$1" >&2; exit "${2:-1}"; }

for knob in NPROC READY_TIMEOUT STOP_GRACE API_PORT; do
    [[ ${!knob} =~ ^[1-9][0-9]*$ ]] || die "$knob must be a positive integer, got '${!knob}'" 2
done
case $ENGINE in
    wsd) ;;
    vllm)
        [[ -n $VLLM_MODEL ]] || die "ENGINE=vllm needs VLLM_MODEL, the model vLLM serves" 2
        # Set, VLLM_PLUGINS is vLLM's allow-list of every plugin group: without wsd in it,
        # vLLM would never load wsd, silently.
        if [[ -n ${VLLM_PLUGINS+set} && ,$VLLM_PLUGINS, != *,wsd,* ]]; then
            die "VLLM_PLUGINS='$VLLM_PLUGINS' leaves wsd out: vLLM loads only the plugins it names; add wsd (VLLM_PLUGINS=${VLLM_PLUGINS:+$VLLM_PLUGINS,}wsd) or unset it" 2
        fi
        "$PYTHON" -c 'import vllm' 2>/dev/null || die "ENGINE=vllm: $PYTHON cannot import vllm" 2
        # vLLM's ranks are the coordinator's default engine: wsctl needs no --engine,
        # and the coordinator's world size (NPROC) is theirs.
        WSD_ENGINE=${WSD_ENGINE:-vllm}
        export WSD_ENGINE WSD_COORDINATOR_ENGINE=$WSD_ENGINE
        ;;
    *) die "ENGINE must be wsd or vllm, got '$ENGINE'" 2 ;;
esac
[[ -z $SHOW_RANKS || $SHOW_RANKS =~ ^[0-9]+(,[0-9]+)*$ ]] \
    || die "SHOW_RANKS must be local ranks such as 0 or 0,1 (empty: all), got '$SHOW_RANKS'" 2
config_args=()
if [[ -n $CONFIG ]]; then
    [[ -r $CONFIG ]] || die "CONFIG: cannot read $CONFIG" 2
    config_args=(--config "$CONFIG")
fi
read -r -a worker_args <<<"$WORKER_ARGS"
read -r -a vllm_args <<<"$VLLM_ARGS"
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
    OMP_NUM_THREADS=$(($(nproc) / NPROC))
    ((OMP_NUM_THREADS >= 1)) || OMP_NUM_THREADS=1
fi
export OMP_NUM_THREADS
# The coordinator admits only registrations that prove they hold this token, and
# only the workers started here inherit it (docs/security.md). Never printed.
if [[ -z ${WSD_AGENT_TOKEN:-} ]]; then
    WSD_AGENT_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
fi
export WSD_AGENT_TOKEN

RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/wsd-local.XXXXXX")
COORDINATOR=""
WORKERS=""

alive() { [[ -n $1 ]] && kill -0 "$1" 2>/dev/null; }

# Wait up to $2 seconds for pid $1 to end (our children are reaped as they end).
wait_gone() {
    local pid=$1 deadline=$((SECONDS + $2))
    while alive "$pid"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# SIGTERM, a bounded wait, then SIGKILL: for one process and its process group.
stop_pid() {
    local pid=$1 grace=$2
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone "$pid" "$grace" && return 0
    say "pid $pid did not stop within $grace s of SIGTERM; killing it" >&2
    kill -KILL -- "-$pid" "$pid" 2>/dev/null || true
    wait_gone "$pid" 5 || say "pid $pid survived SIGKILL" >&2
}

stop_workers() {
    alive "$WORKERS" || return 0
    if [[ $ENGINE == vllm ]]; then
        # vLLM's server drains for --shutdown-timeout, then stops its engine core and
        # workers, whose agents say goodbye: their ranks read stopped.
        stop_pid "$WORKERS" $((10 + STOP_GRACE))
        return 0
    fi
    # torchrun's children are the workers, each leading a session of its own.
    # SIGTERM to them first: they vote to stop at the same step and exit 0, so
    # torchrun ends by itself, quietly. SIGTERM to torchrun works too, noisily.
    local workers
    workers=$(pgrep -P "$WORKERS" || true)
    for pid in $workers; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    if ! wait_gone "$WORKERS" "$STOP_GRACE"; then
        say "the workers did not stop within $STOP_GRACE s; stopping torchrun" >&2
        stop_pid "$WORKERS" "$TORCHRUN_GRACE"
    fi
    for pid in $workers; do  # none should be left; if torchrun had to be killed, some may be
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
}

# Everything we started, workers first and the coordinator last; safe to call twice.
stop_everything() {
    trap '' INT TERM  # a second Ctrl-C must not cut the shutdown short
    stop_workers
    WORKERS=""
    stop_pid "$COORDINATOR" "$COORDINATOR_GRACE"
    COORDINATOR=""
    rm -rf "$RUN_DIR"
}

on_signal() {
    stop_everything
    say "stopped by SIG$1"
    exit 0
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap stop_everything EXIT

# The coordinator, in a session of its own (setsid) so that a terminal's Ctrl-C
# reaches only this script, which stops it last. It learns the world size up
# front, so that clients see the ranks that have not registered yet. Its
# stdout carries one line, "wsd coordinator ready: agents URL clients URL", then
# "metrics URL" when [coordinator] metrics_port is set, naming the ports it bound
# (the OS picks them for port 0); its log goes to stderr.
WSD_COORDINATOR_WORLD_SIZE=${WSD_COORDINATOR_WORLD_SIZE:-$NPROC} \
    setsid "$PYTHON" -m wsd.programs.cli coordinator "${config_args[@]}" >"$RUN_DIR/coordinator.out" &
COORDINATOR=$!

ready=""
deadline=$((SECONDS + READY_TIMEOUT))
while [[ -z $ready ]]; do
    ready=$(grep -m1 '^wsd coordinator ready:' "$RUN_DIR/coordinator.out" || true)
    [[ -n $ready ]] && break
    if ! alive "$COORDINATOR"; then
        code=0
        wait "$COORDINATOR" || code=$?
        COORDINATOR=""
        # 2: the configuration was refused; its message above names the file and key.
        die "the coordinator exited with code $code before it was ready" "$([[ $code == 2 ]] && echo 2 || echo 1)"
    fi
    ((SECONDS < deadline)) || die "the coordinator was not ready within $READY_TIMEOUT s"
    sleep 0.1
done
read -r _ _ _ _ AGENT_ENDPOINT _ CLIENT_ENDPOINT _ METRICS_URL _ <<<"$ready"

if [[ $ENGINE == vllm ]]; then
    # vLLM's OpenAI API server (`vllm serve` as a module: the same server, and it
    # runs where vLLM's CPU package has no working `vllm` command). Its workers
    # load wsd's plugin, on because the coordinator's agent endpoint is set, and
    # read the same configuration file (WSD_CONFIG).
    WSD_COORDINATOR_MODE=external WSD_COORDINATOR_CONNECT_ENDPOINT=$AGENT_ENDPOINT WSD_CONFIG=$CONFIG \
        setsid "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL" \
        --tensor-parallel-size "$NPROC" --host 127.0.0.1 --port "$API_PORT" --shutdown-timeout 10 \
        "${vllm_args[@]}" &
    WORKERS=$!
    started="vLLM's API server on http://127.0.0.1:$API_PORT, $NPROC workers (engine $WSD_ENGINE), pid $WORKERS"
else
    torchrun_args=(--standalone --nproc-per-node "$NPROC")  # --standalone: a rendezvous port the OS picks
    [[ -n $SHOW_RANKS ]] && torchrun_args+=(--local-ranks-filter "$SHOW_RANKS")
    [[ -n $LOG_DIR ]] && torchrun_args+=(--log-dir "$LOG_DIR" --tee 3)
    WSD_COORDINATOR_MODE=external WSD_COORDINATOR_CONNECT_ENDPOINT=$AGENT_ENDPOINT \
        setsid "$PYTHON" -m torch.distributed.run "${torchrun_args[@]}" \
        -m wsd.worker "${config_args[@]}" "${worker_args[@]}" &
    WORKERS=$!
    started="$NPROC workers under torchrun, pid $WORKERS; showing local ranks ${SHOW_RANKS:-all}"
fi

say "clients on $CLIENT_ENDPOINT (agents on $AGENT_ENDPOINT); $started"
say "try   WSD_ENDPOINT=$CLIENT_ENDPOINT wsctl status"
[[ -n $METRICS_URL ]] && say "Prometheus metrics on $METRICS_URL"
say "Ctrl-C stops everything"

# Until a signal (its trap ends the script) or one of the two ends by itself.
code=0
wait -n "$COORDINATOR" "$WORKERS" || code=$?
if ! alive "$COORDINATOR"; then
    say "the coordinator ended unexpectedly; stopping the workers" >&2
    stop_everything
    exit 1
fi
WORKERS_CODE=$code
WORKERS=""
stop_everything
say "the workers ended with exit code $WORKERS_CODE"
[[ $WORKERS_CODE == 0 ]] || exit 1
