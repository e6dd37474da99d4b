"""Test lab: throwaway backing filesystems and offloadfs mounts.

Shared by the mountpoint tests, the benchmark and the demo so that all three
build their fixtures the same way and always clean up after themselves.
"""
