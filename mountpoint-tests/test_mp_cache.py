"""Trust under sharing: what a mount shows after other clients, or its own kernel, changed a file.

Each case was seen on the lab: a new file taken for a deleted one that had
the same inode number, attributes that hid a write or a link count change,
an open that read a file's old size, and the daemon's umask on new files.
"""

import os
import subprocess
import sys


def _in_new_process(code):
    """Run ``code`` in a fresh Python: each step of a POSIX sequence is its own process, as in the suites."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_new_files_take_the_callers_umask_not_the_daemons(mount, backing):
    mnt = mount(backing("ext4"))
    d = str(mnt.path)
    code = (f"import os; os.umask(0); os.mkdir({d!r} + '/d', 0o777); "
            f"os.close(os.open({d!r} + '/f', os.O_CREAT | os.O_WRONLY, 0o666)); os.mkfifo({d!r} + '/p', 0o666); "
            f"os.umask(0o027); os.mkdir({d!r} + '/e', 0o777)")
    _in_new_process(code)
    modes = {n: os.lstat(mnt.backing / n).st_mode & 0o777 for n in ("d", "f", "p", "e")}
    assert modes == {"d": 0o777, "f": 0o666, "p": 0o666, "e": 0o750}
