"""NFSv4.1/4.2 sources: nfs://host[:port]/export[/path], with server-side COPY and CLONE."""
from .backend import NFSBackend

__all__ = ["NFSBackend"]
