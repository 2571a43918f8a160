#!/usr/bin/env bash
# What the test suite needs beyond the Python packages, installed the same way for `make test`
# and CI (.ci/run calls `make test`): the multi-host suite (tests/multihost) runs an sshd in each
# namespace host (Ray's local provider reaches hosts over SSH) and `ray up` syncs with rsync;
# tests/cli/test_top.py runs `pdserve top` in a tmux terminal.
# As root on Debian/Ubuntu they are installed with apt-get; otherwise nothing is installed and
# those tests skip, each with the reason (tests/multihost/conftest.py). Never fails the run.
# promtool (Debian's prometheus package; only the binary is taken from it, so no Prometheus
# server is installed or started) checks the Helm chart's alert rules and dashboard queries
# (tests/deploy/test_dashboards.py; skipped, saying so, without it).
set -u
promtool_prereq() {
    command -v promtool >/dev/null && return 0
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
        echo "prereqs: promtool not installed (not root or no apt-get); tests/deploy/test_dashboards.py's promtool checks will skip" >&2
        return 0
    }
    local dir
    dir=$(mktemp -d)
    ( cd "$dir" && { apt-get download -q prometheus >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get download -q prometheus >/dev/null 2>&1; }; } \
        && dpkg-deb -x prometheus_*.deb root && install -m 0755 root/usr/bin/promtool /usr/local/bin/promtool ) \
        && echo "prereqs: installed promtool (tests/deploy/test_dashboards.py)" >&2 \
        || echo "prereqs: could not install promtool from Debian's prometheus package; its checks will skip" >&2
    rm -rf "$dir"
}
promtool_prereq
have() { [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null && command -v tmux >/dev/null; }
if have; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "prereqs: not root: sshd/rsync/tmux not installed; the tests that need them will skip" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "prereqs: no apt-get: install openssh-server, rsync and tmux yourself; the tests that need them will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q openssh-server rsync tmux >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openssh-server rsync tmux >/dev/null 2>&1; } \
    || echo "prereqs: apt-get could not install openssh-server rsync tmux; the tests that need them will skip" >&2
have && echo "prereqs: installed openssh-server, rsync and tmux (tests/multihost, tests/cli/test_top.py)" >&2
exit 0
