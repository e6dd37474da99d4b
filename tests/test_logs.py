"""Where the daemon logs: logfile=, else the journal, else (-f) stderr, else syslog, else a file."""
import logging
import os
import socket

import pytest

from offloadfs import logs


@pytest.fixture
def no_journal_no_syslog(monkeypatch, tmp_path):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.setattr(logs, "SYSLOG", str(tmp_path / "no-dev-log"))
    monkeypatch.setattr(logs, "ROOT_FILE", str(tmp_path / "root.log"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def emit(chosen, level, msg):
    chosen.handler.handle(logging.LogRecord("offloadfs.t", level, __file__, 1, msg, None, None))
    chosen.handler.flush()


@pytest.fixture
def root_handler():
    """The chosen destination installed as the daemon installs it; the test's own put back after."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


def test_every_line_names_its_mount(no_journal_no_syslog, tmp_path, root_handler):
    """Issue #31: mounts share one log (the journal, syslog, the default file): a line must say
    which mount it is about, wherever it goes."""
    chosen = logs.choose(str(tmp_path / "shared.log"), foreground=False)
    chosen.install(debug=True)
    logs.name_lines("/mnt/one two")
    logging.getLogger("offloadfs.t").debug("hello")
    chosen.handler.flush()
    assert " /mnt/one two offloadfs.t DEBUG hello\n" in (tmp_path / "shared.log").read_text()


def test_logfile_wins(no_journal_no_syslog, tmp_path, monkeypatch):
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    chosen = logs.choose(str(tmp_path / "mine.log"), foreground=True)
    assert chosen.where == str(tmp_path / "mine.log")
    emit(chosen, logging.DEBUG, "kept")
    assert "offloadfs.t DEBUG kept" in (tmp_path / "mine.log").read_text()


def test_journal_lines_carry_their_priority(no_journal_no_syslog, tmp_path, monkeypatch):
    with open(tmp_path / "journal", "w") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            st = os.fstat(2)
            monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
            chosen = logs.choose(None, foreground=False)
            emit(chosen, logging.ERROR, "one\ntwo")
            emit(chosen, logging.DEBUG, "three")
        finally:
            os.dup2(saved, 2)
    assert chosen.where == "the journal"
    assert (tmp_path / "journal").read_text() == "<3>- offloadfs.t: one\n<3>two\n<7>- offloadfs.t: three\n"


def test_journal_stream_of_another_file_is_not_ours(no_journal_no_syslog, monkeypatch):
    """A shell started from a systemd service passes JOURNAL_STREAM on; our stderr is a terminal."""
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    assert logs.choose(None, foreground=True).where == "stderr"


def test_syslog_where_there_is_one(no_journal_no_syslog, tmp_path, monkeypatch):
    path = tmp_path / "dev-log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        monkeypatch.setattr(logs, "SYSLOG", str(path))
        chosen = logs.choose(None, foreground=False)
        assert chosen.where == f"syslog ({path})"
        emit(chosen, logging.INFO, "hello")
        assert server.recv(1000).endswith(f"offloadfs[{os.getpid()}]: - hello\x00".encode())


def test_default_file_for_root_and_for_others(no_journal_no_syslog, tmp_path, monkeypatch):
    open(logs.SYSLOG, "w").close()  # a /dev/log nobody listens on counts as none
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert logs.choose(None, foreground=False).where == str(tmp_path / "root.log")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    chosen = logs.choose(None, foreground=False)
    assert chosen.where == str(tmp_path / "state" / "offloadfs.log")
    emit(chosen, logging.WARNING, "kept")
    assert "WARNING kept" in (tmp_path / "state" / "offloadfs.log").read_text()
