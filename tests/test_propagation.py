"""Which copies of a mount in other namespaces an unmount here leaves (fuse.mount.outliving).

mountpoint-tests/test_mp_kill.py unmounts real peers, slaves and private copies; these are the
chains a test host cannot build cheaply: slaves of a shared slave, and other peer groups.
"""
from offloadfs.fuse.mount import Copy, outliving


def copy(pid, **tags):
    return Copy(pid, "/mnt", "0:99", {k: str(v) for k, v in tags.items()})


def test_peers_slaves_and_their_slaves_go_the_rest_stays():
    ours = copy(1, shared=7)
    peer, slave = copy(2, shared=7), copy(3, master=7)
    shared_slave, its_slave = copy(4, shared=9, master=7), copy(5, master=9)
    private, other_group, slave_of_other = copy(6), copy(7, shared=8), copy(8, master=8)
    everything = [its_slave, peer, slave, shared_slave, private, other_group, slave_of_other]
    assert outliving(everything, ours) == [private, other_group, slave_of_other]


def test_a_private_mount_takes_no_copy_along():
    assert outliving([copy(2, shared=7), copy(3, master=7)], copy(1)) == [copy(2, shared=7), copy(3, master=7)]
