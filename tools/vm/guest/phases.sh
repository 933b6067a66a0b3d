#!/bin/sh
# One phase of the VM lane, run at boot by driver.sh (see there for the markers).
#   lane          check the cgroup tree, run the suites, deploy by the docs, set up
#                 the reboot's state, then ask for a reboot
#   verify-churn  check what the last boot acknowledged, set up the state again, then
#                 churn jobs and hoststate transitions until the host cuts the power
#   verify        check what the last boot acknowledged, then power off
set -u
here=${FICC_VM:-/run/ficc-vm}
scenario="/opt/ficc/venv/bin/python $here/tools/vm/guest/scenario.py"
hoststate="/opt/ficc-test/venv/bin/python $here/tools/vm/guest/hoststate_loop.py"
store=/var/lib/ficc-vm-hoststate
figure() { echo "FICC-FIGURE $1"; }

check_tree() {
    controllers=$(cat /sys/fs/cgroup/cgroup.controllers)
    figure "{\"cgroup.controllers\": \"$controllers\", \"kernel\": \"$(uname -r)\", \"systemd\": \"$(systemctl --version | head -1)\"}"
    for want in cpuset cpu io memory pids; do
        case " $controllers " in
            *" $want "*) ;;
            *) echo "FICC-FAIL the unified cgroup tree lacks the $want controller: $controllers"; return 1 ;;
        esac
    done
    [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] || { echo "FICC-FAIL /sys/fs/cgroup is not cgroup2"; return 1; }
}

test_venv() {
    python3 -m venv /opt/ficc-test/venv
    /opt/ficc-test/venv/bin/pip install -q --no-index --find-links "$here/wheels" \
        ficc-executor-host ficc-hoststate ficc-testkit pytest psutil prometheus_client
}

suites() {
    [ -s "$here/pytest-args" ] || { echo "suites: none asked for"; return 0; }
    # /run is noexec and small here (Debian's initramfs mounts it): the worlds go on disk
    install -d -m 0755 /var/lib/ficc-test
    # shellcheck disable=SC2046
    (cd "$here" && env FICC_SYSTEMD_REQUIRED=1 FICC_VM_LANE=1 \
        FICC_TEST_WORLD_PARENT=/var/lib/ficc-test \
        FICC_PODMAN_WHEELS="$here/wheels" FICC_WHEELS="$here/wheels" $(cat "$here/pytest-env" 2>/dev/null) \
        /opt/ficc-test/venv/bin/pytest -q -s -ra --durations=30 -p no:cacheprovider \
        -o "markers=soak: long reliability loops (FICC_SOAK=1)" $(cat "$here/pytest-args"))
}

case "$1" in
lane)
    check_tree || exit 1
    # The suites first: their daemons run as the shipped unit's own name
    # (ficc-executor-host.service), which the deployment then installs for good.
    test_venv || exit 1
    suites; code=$?
    echo "FICC-VM suites exit $code"
    /bin/sh "$here/tools/vm/guest/deploy.sh" || exit 1
    $scenario setup || exit 1
    touch "$here/reboot-requested"
    exit $code
    ;;
verify-churn)
    check_tree || exit 1
    $hoststate verify $store "$here/acks.jsonl" || echo "FICC-FAIL hoststate verify exited $?"
    exec $scenario verify-churn "$here/acks.jsonl" $hoststate churn $store
    ;;
verify)
    check_tree || exit 1
    $scenario verify "$here/acks.jsonl"; code=$?
    $hoststate verify $store "$here/acks.jsonl" || code=1
    exit $code
    ;;
*)
    echo "FICC-FAIL unknown phase $1"; exit 2 ;;
esac
