#!/bin/sh
# The guest's side of the VM lane (run by ficc-vm-driver.service at every boot, its
# output on the serial console). The host names the phase on the kernel command line
# (ficc.phase=NAME) and reads the markers this prints:
#   FICC-VM phase NAME begins / FICC-VM phase NAME exit CODE
#   FICC-ACK {json}       something the host acknowledged (checked after the next boot)
#   FICC-FIGURE {json}    a measured figure
#   FICC-VM cut-window    from here on the host may cut the power at any moment
# A phase that ends on its own powers the guest off (or reboots it: `reboot` phases).
set -u
here=/run/ficc-vm
phase=$(sed -n 's/.*ficc\.phase=\([a-z_-]*\).*/\1/p' /proc/cmdline)
echo "FICC-VM phase $phase begins (boot $(cat /proc/sys/kernel/random/boot_id), uptime $(cut -d' ' -f1 /proc/uptime) s)"
export FICC_VM="$here" PYTHONUNBUFFERED=1
/bin/sh "$here/tools/vm/guest/phases.sh" "$phase"
code=$?
echo "FICC-VM phase $phase exit $code"
sync
if [ -e "$here/reboot-requested" ] && [ "$code" = 0 ]; then
    systemctl reboot
else
    systemctl poweroff
fi
