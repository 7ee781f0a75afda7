"""What vgpumgr says to a running guest: the QEMU guest agent (agent) and the guest helper it ships
(helper, with the script, unit and cloud-init snippet beside it as data).
Layer 2 (drivers and rules): may import the base modules, hostfs and config.
"""
