#!/usr/bin/env bash
# scripts/setup stops, naming the fix, on a CPU-only torch, a torch of another
# version, and a CUDA toolkit of another major version than the wheel's; and a
# second run on a set-up machine installs nothing. The first three run against
# stand-in virtual environments (SHARDTRAIN_VENV) whose python3 reports a
# stand-in torch and whose pip installs nothing.
# Usage: run.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$1 work=$2
rm -rf "$work"; mkdir -p "$work"
system_python=$(command -v python3)

fake_venv() {  # name torch_version cuda(python literal)
  local venv=$work/$1
  mkdir -p "$venv/bin" "$venv/site/torch"
  printf "__version__ = '%s'\nclass version:\n    cuda = %s\n" "$2" "$3" > "$venv/site/torch/__init__.py"
  printf '#!/bin/sh\nPYTHONPATH=%s exec %s "$@"\n' "$venv/site" "$system_python" > "$venv/bin/python3"
  printf '#!/bin/sh\necho "stand-in pip: installs nothing"\n' > "$venv/bin/pip"
  chmod +x "$venv/bin/python3" "$venv/bin/pip"
  echo "$venv"
}

expect_refusal() {  # name venv needle...
  local name=$1 venv=$2; shift 2
  local out rc=0
  out=$(SHARDTRAIN_VENV=$venv "$src/scripts/setup" 2>&1) || rc=$?
  if [ "$rc" -eq 0 ]; then echo "FAIL $name: scripts/setup accepted it:"; echo "$out"; exit 1; fi
  for needle in "$@"; do
    if ! grep -qF -- "$needle" <<<"$out"; then echo "FAIL $name: the refusal does not say '$needle':"; echo "$out"; exit 1; fi
  done
  echo "ok: $name refused: $(tail -n1 <<<"$out")"
}

expect_refusal cpu_only "$(fake_venv cpu 2.11.0+cpu None)" "CPU-only torch" "--force-reinstall torch==2.11.0"
expect_refusal other_version "$(fake_venv old 2.10.0+cu130 "'13.0'")" "stand-in pip" "has torch 2.10.0+cu130, not 2.11.0" \
  "pip install -r requirements.txt"
expect_refusal other_cuda "$(fake_venv cu12 2.11.0+cu128 "'12.8'")" "built with CUDA 12.8" "set CUDA_HOME"

# The real environment: set up already (the suite was built from it), so nothing is installed.
out=$("$src/scripts/setup" 2>&1)
if grep -q "installing" <<<"$out"; then echo "FAIL: a second scripts/setup installed something:"; echo "$out"; exit 1; fi
echo "ok: a second run installs nothing: $out"
