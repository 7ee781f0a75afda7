"""libvirt and domain XML: connections and domains (driver), who holds a device (holders), rendering
(domain), a migrating domain's vGPUs (migration_xml) and `--print-xml` (dryrun).
Layer 5: may import the layers below it (base, hostfs, config, nvidia, mig, guest, platforms, devices,
placement).
"""
