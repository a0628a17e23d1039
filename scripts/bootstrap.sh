#!/usr/bin/env bash
# Set up ddplaunch on a fresh Debian 12 machine (Python 3.11): system packages, .venv, the package.
#   scripts/bootstrap.sh          what `ddplaunch up cluster.yaml` needs (python3-venv, the venv)
#   scripts/bootstrap.sh --test   also what the test bed needs: openssh-server, iperf3, Slurm, munge,
#                                 podman (+ runc, uidmap) and debootstrap for the container test image
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(python3-venv python3-pip)
[[ "${1:-}" == "--test" ]] && pkgs+=(openssh-server openssh-client iperf3 iproute2 procps util-linux
                                     slurm-wlm slurmctld slurmd slurm-client munge
                                     podman runc uidmap debootstrap)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
  echo "bootstrap: installing ${missing[*]}"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
      --no-install-recommends "${missing[@]}" >/dev/null
fi

py=$(command -v python3.11 || command -v python3)
[[ -x .venv/bin/python ]] || "$py" -m venv .venv
# torch is pinned by constraints.txt (2.13.0, the CPU build), not by the package, which takes any
# torch >= 2.10: never ask for an unpinned torch.
# `up` needs the package; the test bed (--test) also its test extras. Quiet unless it fails.
extra=""; check="import ddplaunch, torch, fabric, pydantic, numpy"
[[ "${1:-}" == "--test" ]] && { extra="[test]"; check="$check, pytest, pytest_timeout, jsonschema, hypothesis, mypy"; }
if ! .venv/bin/python -c "$check" 2>/dev/null || [[ ! -x .venv/bin/py-spy ]]; then
  log=$(mktemp)
  if ! { .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -c constraints.txt -e ".$extra"; } >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; echo "bootstrap: pip install failed (output above)" >&2; exit 1
  fi
  rm -f "$log"
fi
.venv/bin/python -c 'import ddplaunch, torch; print(f"bootstrap: ddplaunch {ddplaunch.__version__}, torch {torch.__version__}")'
