"""The one root every sysfs path hangs from and the only place that reads or writes it (root), and the
host-wide lock around choosing and creating a device (locking).
Layer 1: may import the base modules only (errors, ids, kinds, model, resources).
"""
