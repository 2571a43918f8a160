#!/usr/bin/env bash
# What the test suite needs beyond the Python packages, installed the same way for `make test`
# and CI (.ci/run calls `make test`): the multi-host suite (tests/multihost) runs an sshd in each
# namespace host (Ray's local provider reaches hosts over SSH) and `ray up` syncs with rsync.
# As root on Debian/Ubuntu they are installed with apt-get; otherwise nothing is installed and
# those tests skip, each with the reason (tests/multihost/conftest.py). Never fails the run.
set -u
have() { [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null; }
if have; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "prereqs: not root: sshd/rsync not installed; the multi-host tests that need them will skip" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "prereqs: no apt-get: install openssh-server and rsync yourself; the multi-host tests that need them will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q openssh-server rsync >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openssh-server rsync >/dev/null 2>&1; } \
    || echo "prereqs: apt-get could not install openssh-server rsync; the multi-host tests that need them will skip" >&2
have && echo "prereqs: installed openssh-server and rsync (tests/multihost)" >&2
exit 0
