"""The simulated host (sysfs tree, kernel effects, NVML, libvirt, guests) for the demo and the tests;
nothing outside it imports it (it is chosen by module name). Layer 10: may import everything.
"""
