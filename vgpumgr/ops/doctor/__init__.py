"""`vgpumgr doctor`: says why a host offers no vGPU types, or cannot start a vGPU VM, in the style of libvirt's
`virt-host-validate` and Proxmox's `pve8to9` (docs/sources.md §26). One small function per check, grouped in one
module per section (virtualisation, gpus, services, stack, licensing, vendor); `registry` lists the sections in
the order they run, `report` holds the results, `render` prints them, `explain` answers `--for TYPE`.

Every read goes through the host root (`Host`): sysfs, and /proc, /dev and /boot under the same root, so a
simulated host can show every failing state; systemd's unit states through `Host.kernel.unit_state`."""
