"""What the command line says about itself: --help of each command, the man pages, exit codes."""
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from offloadfs import cli, options
from offloadfs.backends import SCHEMES, backend_class
from offloadfs.fuse.mount import FLAG_OPTIONS

MAN = Path(__file__).parent.parent / "man" / "man8"
HELPER = [sys.executable, "-c", "import sys; from offloadfs.cli import mount_helper_main; sys.exit(mount_helper_main())"]


def run(*args, helper=False):
    cmd = HELPER if helper else [sys.executable, "-m", "offloadfs"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)


def mount_option_names():
    """Every name -o takes: the core's and every backend's."""
    backends = set().union(*(backend_class(scheme).OPTIONS for scheme in SCHEMES))
    return set(FLAG_OPTIONS) | set(options.FLAGS) | set(options.VALUED) | backends | {"rw"}


def option_strings(parser):
    """The options a command takes, argparse's own -h aside."""
    return {s for action in parser._actions for s in action.option_strings if action.dest != "help"}


def subparsers():
    sub = next(a for a in cli._parser()._actions if a.choices and isinstance(a.choices, dict))
    return sub.choices


def test_mount_help_lists_options_sources_and_examples():
    proc = run("mount", "--help")
    assert proc.returncode == 0
    usage = proc.stdout.split("\n\n")[0]
    assert usage.count("MOUNTPOINT") == 1 and "[SOURCE] MOUNTPOINT" in usage, usage
    for name in mount_option_names():
        assert re.search(rf"\b{name}\b", proc.stdout), f"mount --help does not mention -o {name}"
    for form in ("/path", "file:///", "smb://", "nfs://", "source=NAME=SOURCE", "config=FILE"):
        assert form in proc.stdout
    for kind in ("/", "smb://", "nfs://"):
        assert f"offloadfs mount {kind}" in proc.stdout, f"no example mounting {kind}"
    assert "32" in proc.stdout  # the exit status


@pytest.mark.parametrize("command", ["mount", "umount", "status"])
def test_each_command_help_lists_what_it_takes_with_an_example(command):
    parser = subparsers()[command]
    proc = run(command, "--help")
    assert proc.returncode == 0
    for action in parser._actions:
        assert action.help, f"{command} {action.option_strings or action.dest}: no help text"
        for s in action.option_strings:
            assert s in proc.stdout
    assert f"offloadfs {command} " in proc.stdout.split("examples:")[1]


def test_mount_helper_help():
    proc = run("--help", helper=True)
    assert proc.returncode == 0
    for flag in ("-f", "-n", "-s", "-v", "-o", "-t", "-N"):
        assert re.search(rf"^\s+{flag}\b.*\S", proc.stdout, re.M), f"mount.offloadfs --help: {flag}"
    assert "mount -t offloadfs" in proc.stdout


def test_version_is_the_installed_package_version():
    """pyproject.toml is the one place the version is written; --version and the man pages follow it."""
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout == f"offloadfs {metadata.version('offloadfs')}\n", proc
    for page in ("offloadfs.8", "mount.offloadfs.8"):
        assert not re.search(r"\d+\.\d+\.\d+", man(page).splitlines()[0]), f"{page}: .TH names a version"


def man(page):
    return (MAN / page).read_text()


def test_man_pages_cover_every_option():
    text = man("offloadfs.8")
    for command, parser in subparsers().items():
        assert f"offloadfs {command}" in text
        for s in option_strings(parser):
            assert s.replace("-", r"\-") in text, f"offloadfs.8: {command} {s}"
    for name in mount_option_names():
        assert re.search(rf"\b{name}\b", text.replace(r"\-", "-")), f"offloadfs.8: -o {name}"
    helper = man("mount.offloadfs.8")
    for flag in ("-f", "-n", "-s", "-v", "-o", "-t", "-N"):
        assert rf"\{flag}" in helper, f"mount.offloadfs.8: {flag}"
    for page in (text, helper):
        assert ".SH EXIT STATUS" in page and "32" in page


@pytest.mark.parametrize("page", ["offloadfs.8", "mount.offloadfs.8"])
def test_man_pages_render_without_warnings(page):
    proc = subprocess.run(["groff", "-man", "-ww", "-z", MAN / page], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr


def test_argparse_usage_errors_exit_1():
    assert run("mount").returncode == 1
    assert run("bogus-command").returncode == 1
    assert run("only-source", helper=True).returncode == 1
