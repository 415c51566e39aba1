#!/usr/bin/env bash
# Passwordless ssh from this machine to itself on a side port, for the test of the deepspeed launcher's pdsh mode
# (tests/test_launchers.py): one `deepspeed --hostfile` that starts the processes of two loopback "hosts" over ssh.
# Runs as root; needs the Debian packages pdsh, openssh-server and openssh-client.
#
#   scripts/loopback_ssh.sh start     # install what is missing, then start sshd on 127.0.0.1:$PORT (idempotent)
#   scripts/loopback_ssh.sh check     # exit 0 when `ssh -p $PORT 127.0.0.1` logs in without a password
#   scripts/loopback_ssh.sh stop      # stop that sshd
#
# PORT is $HARNESS_SSH_PORT or 2222. The key is ~/.ssh/id_ed25519 (made if missing, never replaced); its public
# half is added to ~/.ssh/authorized_keys, and both loopback names go to ~/.ssh/known_hosts.
set -euo pipefail
PORT=${HARNESS_SSH_PORT:-2222}
PIDFILE=/tmp/harness-loopback-sshd.pid

log() { echo "loopback_ssh.sh: $*" >&2; }

check() {
  ssh -o BatchMode=yes -o ConnectTimeout=5 -p "$PORT" 127.0.0.1 true 2>/dev/null && command -v pdsh >/dev/null
}

install() {
  command -v pdsh >/dev/null && [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null && return
  [ "$(id -u)" = 0 ] || { log "error: installing pdsh and openssh needs root"; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q pdsh openssh-server openssh-client >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q pdsh openssh-server openssh-client >&2; }
}

start() {
  check && return
  install
  mkdir -p ~/.ssh /run/sshd && chmod 700 ~/.ssh
  [ -f ~/.ssh/id_ed25519 ] || ssh-keygen -q -t ed25519 -N "" -f ~/.ssh/id_ed25519
  touch ~/.ssh/authorized_keys && chmod 600 ~/.ssh/authorized_keys
  grep -qxF "$(cat ~/.ssh/id_ed25519.pub)" ~/.ssh/authorized_keys || cat ~/.ssh/id_ed25519.pub >> ~/.ssh/authorized_keys
  [ -f /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -A >&2
  /usr/sbin/sshd -p "$PORT" -o ListenAddress=127.0.0.1 -o PermitRootLogin=prohibit-password \
    -o PasswordAuthentication=no -o PidFile="$PIDFILE"
  local keys="" _
  for _ in $(seq 20); do  # until sshd listens
    keys=$(ssh-keyscan -p "$PORT" 127.0.0.1 localhost 2>/dev/null) && [ -n "$keys" ] && break
    sleep 0.5
  done
  echo "$keys" >> ~/.ssh/known_hosts
  check || { log "error: sshd on 127.0.0.1:$PORT does not let this user in"; exit 1; }
  log "sshd on 127.0.0.1:$PORT"
}

stop() {
  [ -f "$PIDFILE" ] && kill "$(cat "$PIDFILE")" 2>/dev/null || true
  rm -f "$PIDFILE"
}

case "${1:-}" in
  start) start ;;
  check) check ;;
  stop) stop ;;
  *) echo "usage: $0 start|check|stop"; exit 2 ;;
esac
