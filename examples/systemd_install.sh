#!/usr/bin/env bash
# Install meshd as a systemd service on this machine (run as root, from a meshd checkout).
#
#   sudo examples/systemd_install.sh                         # a new mesh: makes a fresh secret
#   sudo MESHD_SECRET_FILE=/path/to/secret examples/systemd_install.sh   # join an existing one
#   sudo MESHD_PREFIX=/srv/meshd examples/systemd_install.sh             # another venv path
#
# What it does, each step safe to rerun:
#   1. a virtualenv at $MESHD_PREFIX (default /opt/meshd) with meshd installed (CPU torch);
#      /usr/local/bin/meshd and meshctl link to it, so the unit's `/usr/bin/env meshd` finds it
#   2. /etc/meshd/meshd.toml (kept if present) and /etc/meshd/env with MESHD_MESH_SECRET
#      (root:root 0600; systemd reads it before dropping to the service's dynamic user)
#   3. /etc/systemd/system/meshd.service from systemd/meshd.service, then enable --now
# The identity key and control socket live in /var/lib/meshd (StateDirectory=meshd).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
    echo "run as root (sudo $0)" >&2
    exit 1
fi
PREFIX=${MESHD_PREFIX:-/opt/meshd}
PY=${PYTHON:-python3}

echo "== 1. meshd in $PREFIX"
if [[ ! -x "$PREFIX/bin/python" ]]; then
    "$PY" -m venv "$PREFIX"
fi
"$PREFIX/bin/python" -m pip install -q --upgrade pip
# CPU torch first, so nothing pulls a CUDA build (drop this line on a GPU node).
"$PREFIX/bin/python" -c "import torch" 2>/dev/null ||
    "$PREFIX/bin/python" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
"$PREFIX/bin/python" -m pip install -q .
ln -sf "$PREFIX/bin/meshd" /usr/local/bin/meshd
ln -sf "$PREFIX/bin/meshctl" /usr/local/bin/meshctl

echo "== 2. /etc/meshd"
install -d -m 0755 /etc/meshd
if [[ ! -f /etc/meshd/meshd.toml ]]; then
    cat > /etc/meshd/meshd.toml <<'EOF'
# meshd config (docs/configuration.md). The secret comes from /etc/meshd/env.
# state_dir is unset: the daemon uses $STATE_DIRECTORY = /var/lib/meshd.
listen_host = "0.0.0.0"
listen_port = 7391
log_format = "json"
# model = "/srv/models/Llama-3.2-1B-Instruct"   # default: the built-in model
# join = ["192.168.1.20:7391"]                  # when mDNS cannot see the others

[api]
host = "127.0.0.1"
port = 7392

[mdns]
# interfaces = ["192.168.1.20"]                 # default: every non-loopback interface
EOF
    chmod 0644 /etc/meshd/meshd.toml
fi
if [[ ! -f /etc/meshd/env ]]; then
    if [[ -n "${MESHD_SECRET_FILE:-}" ]]; then
        secret=$(cat "$MESHD_SECRET_FILE")
    else
        secret=$(head -c 32 /dev/urandom | base64 | tr -d '\n')
        echo "   new mesh secret: copy /etc/meshd/env to the other nodes (it is the mesh's key)"
    fi
    (umask 077 && printf 'MESHD_MESH_SECRET=%s\n' "$secret" > /etc/meshd/env)
fi
chmod 0600 /etc/meshd/env

echo "== 3. the service"
install -m 0644 systemd/meshd.service /etc/systemd/system/meshd.service
systemctl daemon-reload
systemctl enable --now meshd.service
systemctl --no-pager status meshd.service | head -5 || true
echo "logs: journalctl -u meshd -f    status: sudo meshctl status --socket /var/lib/meshd/control.sock"
