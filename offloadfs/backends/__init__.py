"""Backends: one module or package per protocol behind the interface in base.py.

A source URL's scheme picks the backend.  Each backend class lists the mount
options it takes in ``OPTIONS``; options the core does not know are passed
to every backend of the mount that takes them.
"""
import contextlib
import importlib
from urllib.parse import urlsplit

from .base import Backend

# scheme -> (module, class); modules load on first use so one protocol's
# dependencies never stand in the way of another's.
SCHEMES = {
    "file": ("offloadfs.backends.local", "LocalBackend"),
    "smb": ("offloadfs.backends.smb", "SMBBackend"),
    "nfs": ("offloadfs.backends.nfs", "NFSBackend"),
}


class SourceError(Exception):
    """A source cannot be opened; the message is meant for the user."""


def scheme_of(url):
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_class(scheme):
    try:
        module, name = SCHEMES[scheme]
    except KeyError:
        supported = ", ".join(f"{s}://" for s in SCHEMES)
        raise SourceError(f"unsupported scheme {scheme}:// (supported: a path, {supported})") from None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SourceError(f"the {scheme}:// backend cannot be loaded: {e}") from None


def check_options(urls, options):
    """Refuse an option that no backend of these sources takes (only their modules are loaded),
    with the form to use where another tool's option was meant."""
    classes = [backend_class(scheme_of(url)) for url in urls]
    known = set().union(*(cls.OPTIONS for cls in classes))
    for name in options:
        if name not in known:
            hint = next((cls.HINTS[name] for cls in classes if name in cls.HINTS), None)
            raise SourceError(f"unknown mount option '{name}'" + (f": {hint}" if hint else ""))


def shown(url):
    """``url`` as a message may quote it: a password in it (refused) is left out."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", "@", 1)).geturl()


@contextlib.contextmanager
def _source_errors(url):
    """A source that is not there, or not a directory, as a SourceError that names it."""
    try:
        yield
    except FileNotFoundError:
        raise SourceError(f"source {url}: no such directory") from None
    except NotADirectoryError:
        raise SourceError(f"source {url}: not a directory") from None
    except OSError as e:
        raise SourceError(f"source {url}: {e.strerror}") from None


def _options_for(cls, options):
    return {k: v for k, v in options.items() if k in cls.OPTIONS}


def check_source(url, options):
    """Check ``url`` and the mount's backend options as open_backend will, reaching no server (all
    that mount -f does): ValueError for a malformed URL or option, SourceError for what is not there."""
    cls = backend_class(scheme_of(url))
    with _source_errors(url):
        cls.check(url, _options_for(cls, options))


def open_backend(url, options) -> Backend:
    """The backend serving ``url``, given the backend options of the mount ({name: value or True})."""
    cls = backend_class(scheme_of(url))
    with _source_errors(url):
        try:
            return cls(url, _options_for(cls, options))
        except ValueError as e:
            raise SourceError(f"source {shown(url)}: {e}") from None
