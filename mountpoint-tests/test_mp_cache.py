"""Trust under sharing: what a mount shows after other clients, or its own kernel, changed a file.

Each case was seen on the lab: a new file taken for a deleted one that had
the same inode number, attributes that hid a write or a link count change,
an open that read a file's old size, and the daemon's umask on new files.
"""

import os
import subprocess
import sys
import time


def _in_new_process(code):
    """Run ``code`` in a fresh Python: each step of a POSIX sequence is its own process, as in the suites."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_new_file_that_took_a_deleted_files_inode_number_is_that_new_file(mount_on):
    """nfsd on xfs gives the next new file the number at once (ganesha keeps the old file open)."""
    mnt = mount_on("nfsd")
    seen = mnt.path / "f"
    seen.write_bytes(b"old")
    assert seen.read_bytes() == b"old"  # this mount knows the file now
    ino = os.stat(mnt.backing / "f").st_ino
    (mnt.backing / "f").unlink()  # another client deletes it and makes a new one
    for _ in range(40):  # the number is free once nfsd's file cache let the old file go
        (mnt.backing / "f").write_bytes(b"the new file")
        if os.stat(mnt.backing / "f").st_ino == ino:
            break
        (mnt.backing / "f").unlink()
        time.sleep(0.5)
    assert os.stat(mnt.backing / "f").st_ino == ino, "the server did not reuse the inode number"
    with open(seen, "rb") as f:
        assert f.read() == b"the new file"
        assert os.fstat(f.fileno()).st_size == 12
    assert seen.stat().st_size == 12


def test_new_files_take_the_callers_umask_not_the_daemons(mount, backing):
    mnt = mount(backing("ext4"))
    d = str(mnt.path)
    code = (f"import os; os.umask(0); os.mkdir({d!r} + '/d', 0o777); "
            f"os.close(os.open({d!r} + '/f', os.O_CREAT | os.O_WRONLY, 0o666)); os.mkfifo({d!r} + '/p', 0o666); "
            f"os.umask(0o027); os.mkdir({d!r} + '/e', 0o777)")
    _in_new_process(code)
    modes = {n: os.lstat(mnt.backing / n).st_mode & 0o777 for n in ("d", "f", "p", "e")}
    assert modes == {"d": 0o777, "f": 0o666, "p": 0o666, "e": 0o750}
