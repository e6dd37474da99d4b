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
