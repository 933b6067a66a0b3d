#!/bin/sh
# Deploy the executor host on this fresh Debian 12 machine exactly as
# docs/operations.md tells an administrator: wheels into a venv, accounts, slot
# filesystems with `provision-slot --persist unit`, the image entry, the pin, the
# configuration, the shipped unit with the Podman drop-in and one RequiresMountsFor=
# per slot, `systemctl enable --now`, then `smoke-test`. The guest has no network:
# the wheels and their dependencies come from the lane's wheelhouse (the guide's
# `--no-index --find-links DIR`). Each step is echoed; the first failure stops it.
set -eu
here=${FICC_VM:-/run/ficc-vm}
wheels="$here/wheels"
step() { echo "deploy: $*"; }
umask 022

step "install the wheels (Installing)"
python3 -m venv /opt/ficc/venv
/opt/ficc/venv/bin/pip install -q --no-index --find-links "$wheels" \
    "$wheels"/ficc_hoststate-*.whl "$wheels"/ficc_protocol-*.whl "$wheels"/ficc_provider_sdk-*.whl \
    "$wheels"/ficc_executor_host-*.whl
/opt/ficc/venv/bin/pip install -q --no-index --find-links "$wheels" "$wheels"/ficc_provider_podman-*.whl
chown -R root:root /opt/ficc && chmod -R go-w /opt/ficc
/opt/ficc/venv/bin/ficc-executor --version
ln -sf /opt/ficc/venv/bin/ficc-executor /usr/local/bin/ficc-executor

step "the pin (provider-digest)"
/opt/ficc/venv/bin/ficc-executor provider-digest podman
digest=$(/opt/ficc/venv/bin/ficc-executor provider-digest podman --json \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["package_digest"])')

step "directories"
install -d -o root -g root -m 0700 /var/lib/ficc-executor
install -d -o root -g root -m 0711 /run/ficc-executor
install -d -o root -g root -m 0755 /srv/ficc /srv/ficc/slots /srv/ficc/images
install -d -o root -g root -m 0755 /etc/ficc
install -d -o root -g root -m 0700 /var/lib/ficc-slots

step "accounts"
for name in ficc-transport ficc-slot-0 ficc-slot-1 ficc-slot-2 ficc-slot-3; do
    useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$name"
done

step "slot filesystems (provision-slot --persist unit)"
for n in 0 1 2 3; do
    /opt/ficc/venv/bin/ficc-executor provision-slot --image /var/lib/ficc-slots/small-$n.img \
        --mount /srv/ficc/slots/small-$n --bytes 256M --inodes 20000 --persist unit --json \
        > /etc/ficc/slot-$n.json
    unit=$(systemd-escape --path --suffix=mount /srv/ficc/slots/small-$n)
    systemctl daemon-reload
    systemctl enable "$unit"
done

step "the image (Adding an image)"
install -o root -g root -m 0644 "$here/image/ficc-test.oci.tar" /srv/ficc/images/busybox.oci.tar
/opt/ficc/venv/bin/ficc-podman-image /srv/ficc/images/busybox.oci.tar --format json > /etc/ficc/image.json
cat /etc/ficc/image.json

step "the configuration (/etc/ficc/executor-host.toml, mode 0600)"
python3 "$here/tools/vm/guest/write_config.py" --digest "$digest" \
    --image /etc/ficc/image.json --slot /etc/ficc/slot-0.json --slot /etc/ficc/slot-1.json \
    --slot /etc/ficc/slot-2.json --slot /etc/ficc/slot-3.json \
    > /etc/ficc/executor-host.toml.new
install -o root -g root -m 0600 /etc/ficc/executor-host.toml.new /etc/ficc/executor-host.toml
rm /etc/ficc/executor-host.toml.new
/opt/ficc/venv/bin/ficc-executor check-config --config /etc/ficc/executor-host.toml

step "the unit, the Podman drop-in, the slots' RequiresMountsFor="
cp /opt/ficc/venv/share/ficc-executor-host/ficc-executor-host.service /etc/systemd/system/
install -D -m 0644 /opt/ficc/venv/share/ficc-provider-podman/podman.conf \
    /etc/systemd/system/ficc-executor-host.service.d/podman.conf
printf '[Unit]\nRequiresMountsFor=/srv/ficc/slots/small-0 /srv/ficc/slots/small-1 /srv/ficc/slots/small-2 /srv/ficc/slots/small-3\n' \
    > /etc/systemd/system/ficc-executor-host.service.d/slots.conf
systemctl daemon-reload
systemctl enable --now ficc-executor-host
systemctl --no-pager status ficc-executor-host | head -5

step "the first job (smoke-test)"
/opt/ficc/venv/bin/ficc-executor smoke-test --config /etc/ficc/executor-host.toml
/opt/ficc/venv/bin/ficc-executor status --config /etc/ficc/executor-host.toml
