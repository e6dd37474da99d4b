"""stats.py: who sees which copies in flight in the status attribute."""
from offloadfs.backends.base import CALLER, Caller
from offloadfs.stats import Stats


def copies_seen(stats, uid):
    return {(c["uid"], c["source"]) for c in stats.snapshot(uid=uid)["copies_in_flight"]}


def test_a_copy_is_its_callers_and_other_users_see_only_their_own():
    """Under allow_other the status attribute is readable by every user; paths of other users' copies
    (names inside their private directories) are theirs, the mount owner's and root's to see."""
    stats = Stats("/mnt", {})
    stats.owner = 1000
    for uid, name in ((0, "root"), (1000, "owner"), (65534, "nobody"), (4242, "other")):
        token = CALLER.set(Caller(uid, uid))
        try:
            stats.start_copy(f"private-{name}/src", f"private-{name}/dst", 10)
        finally:
            CALLER.reset(token)
    everyone = {(0, "private-root/src"), (1000, "private-owner/src"), (65534, "private-nobody/src"),
                (4242, "private-other/src")}
    assert copies_seen(stats, 0) == everyone
    assert copies_seen(stats, 1000) == everyone
    assert copies_seen(stats, 65534) == {(65534, "private-nobody/src")}
    assert copies_seen(stats, 7) == set()
    assert "private-root" not in str(stats.snapshot(uid=65534))
    assert stats.snapshot(uid=65534)["counters"]["copy_requests"] == 4  # the counters stay the mount's


def test_bytes_kept_off_the_network_are_the_bytes_not_sent():
    """Issue #31: an offloaded copy request spares the read and the write; a recognised copy only the
    write (the program's reads brought its bytes down already), less what reading it back cost and
    what was written over it after all; a streamed copy spares nothing."""
    stats = Stats("/mnt", {})
    asked = stats.start_copy("a", "b", 100)
    stats.moved(asked, "server_copy", 100, True)
    found = stats.start_copy("a", "c", 60, recognised=True)
    stats.moved(found, "clone", 60, True)
    streamed = stats.start_copy("a", "d", 10)
    stats.moved(streamed, "stream", 10, True)
    stats.read_back(20)
    stats.written_over(5)
    counters = stats.snapshot()["counters"]
    assert counters["bytes_kept_off_network"] == 2 * 100 + 60 - 20 - 5
    assert counters["recognised_verified"] == 20
